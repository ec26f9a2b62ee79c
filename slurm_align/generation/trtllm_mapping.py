"""megatron full state dict -> the weights TensorRT-LLM 1.x's PyTorch backend loads; pure torch.

TensorRT-LLM 1.2's PyTorch backend builds its model from a Hugging Face config.json and loads
HF-named, full (unsharded) tensors: each TP worker slices its own part inside the model's
load_weights (q/k/v and gate/up by output rows into the fused qkv_proj / gate_up_proj modules,
o_proj and down_proj by input columns). The in-place update takes the same path
(WorkerExtension.update_weights -> model_loader.reload). So the mapping is megatron -> HF, with
the tables of models/hf/mapping.py that the HF exporter uses (one table, not two), limited to
the architectures that backend has a model for: Llama, Qwen2, Qwen3, Mistral, and the MoE
Qwen3-MoE and Mixtral (tensorrt_llm/_torch/models has modeling_llama/qwen2/qwen3/mistral and
Qwen3-MoE/Mixtral weight mappers; no GPT-2: slurm-align's default GPT and GPT-2 style models are
refused with the alternatives named).

Runs anywhere (no tensorrt_llm import): the engine uses it on GPUs, the tests on CPU.
`trtllm_tp_slice` states what TP worker r takes from each attention/MLP tensor, so the tests can
check it against megatron's own TP shards (the same heads, the same gate/up rows) at TP 1, 2, 4.
"""

from __future__ import annotations

from typing import Any

import torch

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.generation.params import GenerationError
from slurm_align.models.hf.config import export_model_type, hf_config_dict
from slurm_align.models.hf.mapping import sources, to_hf

# HF model_type -> the architecture TensorRT-LLM's PyTorch backend instantiates for it.
PYTORCH_BACKEND_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                         "mixtral": "MixtralForCausalLM"}
# HF linear name suffix -> the dim a TP worker splits (0: output rows, column parallel; 1: input
# columns, row parallel). Biases of column-parallel linears split with their rows; o_proj's and
# down_proj's biases are added once, whole.
# MoE experts (Qwen3-MoE's gate/up/down_proj, Mixtral's w1/w3/w2) split the same way under
# TensorRT-LLM's MoE tensor parallelism (expert width); routers ("gate") and q/k norms stay whole.
_TP_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
           "w1": 0, "w3": 0, "w2": 1}


def supported_model_type(cfg: ModelConfig, archs: dict[str, str], engine: str) -> str:
    """The HF model_type of `cfg` when `archs` (model_type -> the engine's architecture) has it;
    a GenerationError naming the engine and what it runs otherwise."""
    try:
        model_type = export_model_type(cfg, None)
    except ConfigError as e:
        model_type = f"none ({e})"
    if model_type not in archs:
        raise GenerationError(
            f"generation engine {engine!r} has no model for this architecture (HF model_type {model_type}; "
            f"position_embedding={cfg.position_embedding}, normalization={cfg.normalization}, "
            f"activation={cfg.activation}); it runs {', '.join(archs)}")
    return model_type


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF model_type TensorRT-LLM runs this model as; a GenerationError for the others."""
    try:
        model_type = export_model_type(cfg, None)
    except ConfigError as e:
        model_type = f"none ({e})"
    if model_type not in PYTORCH_BACKEND_ARCHS:
        raise GenerationError(
            f"generation engine 'trtllm': TensorRT-LLM 1.x's PyTorch backend has no model for this "
            f"architecture (HF model_type {model_type}; position_embedding={cfg.position_embedding}, "
            f"normalization={cfg.normalization}, activation={cfg.activation}); it runs "
            f"{', '.join(PYTORCH_BACKEND_ARCHS)}-style models (rope, RMSNorm, swiglu). Use "
            "generation.engine 'torch' for GPT-2-style models (learned positions, LayerNorm, gelu)")
    return model_type


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of the model TensorRT-LLM builds (weights come later, in place)."""
    model_type = hf_model_type(cfg)
    out = hf_config_dict(cfg, model_type)
    out["architectures"] = [PYTORCH_BACKEND_ARCHS[model_type]]
    return out


def hf_weights(full: dict[str, torch.Tensor], cfg: ModelConfig,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named full tensors (vocab rows cut to the real vocabulary) from a full megatron dict."""
    converted = hf_bucket(full, check_full_names(full, cfg), cfg)
    return {hf_name: t.to(dtype or t.dtype).contiguous() for hf_name, t in converted.items()}


def hf_bucket(full: dict[str, torch.Tensor], names: list[str], cfg: ModelConfig,
              model_type: str | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors of the megatron tensors `names` only (one refit bucket): converting a
    bucket at a time keeps the converted copy to one bucket, not a second model. `model_type`:
    the engine's (default: TensorRT-LLM's, hf_model_type)."""
    model_type = model_type or hf_model_type(cfg)
    table = sources(cfg, model_type, value_head=False, score_head=False)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        out.update(to_hf(table[name], full[name].detach(), cfg, model_type))
    return out


def check_full_names(full: dict[str, torch.Tensor], cfg: ModelConfig, model_type: str | None = None) -> list[str]:
    """The megatron names of `full` in the model's order; a GenerationError when they do not
    match the model (hf_weights checks with it before converting). `model_type` as in hf_bucket."""
    model_type = model_type or hf_model_type(cfg)
    table = sources(cfg, model_type, value_head=False, score_head=False)
    got = {k for k in full if not k.endswith("_extra_state")}
    missing, extra = sorted(set(table) - got), sorted(got - set(table))
    if missing or extra:
        raise GenerationError(f"full state dict does not match the {model_type} model: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    return list(table)


def trtllm_tp_slice(hf_name: str, t: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The part of an attention/MLP tensor that TP worker `tp_rank` of `tp_size` holds."""
    module = hf_name.rsplit(".", 2)[-2]
    if module not in _TP_DIM:
        raise GenerationError(f"{hf_name}: not a tensor-parallel linear (norms stay whole, "
                              "embeddings and lm_head split by vocabulary rows)")
    dim = _TP_DIM[module]
    if hf_name.endswith(".bias") and dim == 1:
        return t
    if t.shape[dim] % tp_size:
        raise GenerationError(f"{hf_name}: {t.shape[dim]} rows/columns do not split over TP {tp_size}")
    return t.chunk(tp_size, dim)[tp_rank]
