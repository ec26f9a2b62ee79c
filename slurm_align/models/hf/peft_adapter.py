"""A LoRA model's adapters as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
that `peft.PeftModel.from_pretrained(base, folder)` loads onto the HF base model.

megatron's fused layers map onto HF's separate ones with the weights' own table (mapping.py):
the fused QKV adapter (one A, B in megatron's per-group [q.., k, v] rows) becomes q_proj, k_proj
and v_proj adapters sharing that A, with B's rows split as the QKV weight's are (B_q A is exactly
the q rows of B A); SwiGLU fc1's B_gate / B_up become gate_proj / up_proj with the shared A.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.models.hf.mapping import Source, to_hf
from slurm_align.models.lora import adapters

PREFIX = "base_model.model."


def peft_tensors(chunks: list, cfg: ModelConfig, model_type: str, srcs: dict[str, Source]) -> dict[str, torch.Tensor]:
    """PEFT's tensor names -> adapter tensors, from a TP=1, PP=1 model's adapters."""
    out: dict[str, torch.Tensor] = {}
    for name, a in adapters(chunks):
        src = srcs[name + ".weight"]
        if src.conv1d or (src.kind == "qkv" and len(src.hf) != 3):
            raise ConfigError([f"export hf --adapter: {model_type} models (fused Conv1D layers) have no PEFT "
                               "adapter layout here; export the merged weights (without --adapter)"])
        parts: dict[str, torch.Tensor]
        if src.kind == "glu":
            parts = {src.hf[0]: a.lora_B_gate, src.hf[1]: a.lora_B_up}
        else:
            parts = to_hf(src, a.lora_B.detach(), cfg, model_type)
        for hf_name, b in parts.items():
            module = PREFIX + hf_name[: -len(".weight")]
            out[f"{module}.lora_A.weight"] = a.lora_A.detach().contiguous().clone()
            out[f"{module}.lora_B.weight"] = b.detach().contiguous().clone()
    return out


def write_peft_adapter(folder: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig, base: str | None) -> None:
    """adapter_model.safetensors and adapter_config.json into `folder` (the caller publishes it)."""
    lora = cfg.lora
    assert lora is not None, "an adapter export is of a LoRA checkpoint"
    targets = sorted({name[len(PREFIX):].split(".lora_")[0].rsplit(".", 1)[1] for name in tensors})
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "base_model_name_or_path": base, "inference_mode": True, "use_rslora": False,
              "modules_to_save": None}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
