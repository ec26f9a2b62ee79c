"""megatron-core GPTModel builders: the policy/reference LM and the value/reward model.

The architecture comes from ModelConfig (/work/coord/MODEL_FIELDS.md): slurm-align's own GPT by
default (learned positions, LayerNorm, GELU, biases, untied output), or Llama / Qwen2 / Mistral /
GPT-2 (RoPE with Llama-3 scaling, RMSNorm, SwiGLU, grouped-query attention, QKV bias, tied
embeddings). No dropout. Transformer Engine layer spec when CUDA and TE are present and the
model computes in fp16/bf16, the local spec otherwise (`layer_spec`). `build_gpt` returns a
list of model chunks (one: this rank's pipeline stage).

Tied embeddings under pipeline parallelism: megatron keeps a copy of the embedding on the last
stage and syncs it with `weight.data.cuda()` (fails on CPU), so with PP > 1 the model is built
untied and weights.py keeps the copy equal (same init, same loaded values, summed gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule

from slurm_align import megatron_import
from slurm_align.config.run import ModelConfig, TrainingConfig
from slurm_align.models.cpu_compat import apply_cpu_compat, cuda_present, seed_model_parallel
from slurm_align.models.hf.loader import load_hf_weights
from slurm_align.models.weights import init_weights, mark_tied_embedding

with megatron_import.unused_hidden():   # its multi-latent attention imports triton, a GPU kernel compiler
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu_new (tanh approximation)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": torch.nn.functional.gelu, "gelu_tanh": gelu_tanh, "swiglu": torch.nn.functional.silu}


def moe_fields(model_cfg: ModelConfig, pctx: Any) -> dict[str, Any]:
    """TransformerConfig's MoE fields: megatron's TopKRouter, SequentialMLP experts (no grouped
    GEMM: it needs CUDA kernels), the all-to-all token dispatcher over the EP group, no token
    dropping (capacity None), the Switch load-balancing loss at the configured coefficient."""
    if model_cfg.num_experts is None:
        return {}
    return {
        "num_moe_experts": model_cfg.num_experts,
        "moe_router_topk": model_cfg.moe_router_topk,
        # pre-softmax: softmax over all experts, then top-k (no renormalisation); otherwise
        # top-k of the logits, then softmax over those k (= renormalised top-k probabilities).
        "moe_router_pre_softmax": not model_cfg.moe_norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss" if model_cfg.moe_aux_loss_coeff > 0 else "none",
        # megatron scales each rank's aux loss by 1/micro-batches; the trainers then SUM the
        # gradients over DP (their losses are normalised by the global token count), so the
        # coefficient is split over DP ranks: it weighs the DP-mean aux loss, as configured.
        "moe_aux_loss_coeff": model_cfg.moe_aux_loss_coeff / max(getattr(pctx, "dp_size", 1), 1),
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_router_dtype": "fp32",
        "expert_model_parallel_size": getattr(pctx, "ep_size", 1),
    }


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def recompute_fields(training: TrainingConfig | None) -> dict[str, Any]:
    """TransformerConfig's activation-recompute fields for training.recompute."""
    if training is None or training.recompute == "none":
        return {}
    if training.recompute == "selective":   # megatron's default module list: the attention core
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": training.recompute_num_layers}


def transformer_config(model_cfg: ModelConfig, pctx: Any, training: TrainingConfig | None = None) -> TransformerConfig:
    """megatron's TransformerConfig of the model; `training` (a trained model only) sets the
    precision and activation recompute (frozen models: fp32, no recompute)."""
    dtype = DTYPES[training.precision if training is not None else "fp32"]
    return TransformerConfig(
        **moe_fields(model_cfg, pctx),
        **recompute_fields(training),
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.query_groups,
        kv_channels=model_cfg.head_dim,
        ffn_hidden_size=model_cfg.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.norm_epsilon,
        add_bias_linear=model_cfg.add_bias_linear,
        add_qkv_bias=model_cfg.add_qkv_bias or model_cfg.add_bias_linear,
        # Qwen3: a norm of head_dim over each head's q and k (the spec's q/k_layernorm modules).
        qk_layernorm=model_cfg.qk_layernorm,
        # swiglu: megatron's MLP computes silu(x[:half]) * x[half:] from fc1 = [gate; up].
        gated_linear_unit=model_cfg.activation == "swiglu",
        activation_func=_ACTIVATIONS[model_cfg.activation],
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        # weights.init_weights (or an HF import) sets every tensor; megatron's own CPU init
        # would build each full tensor once more on every rank (see mark_tp_weights).
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=0.02,
        tensor_model_parallel_size=pctx.tp_size,
        pipeline_model_parallel_size=pctx.pp_size,
        # The PP schedule needs to know the activation dtype for its p2p buffers.
        pipeline_dtype=dtype,
    )


def mark_tp_weights(model: torch.nn.Module) -> None:
    """Tensor-parallel attributes of the local spec's weights. megatron's CPU-initialised layers
    set them only while drawing their init (`_initialize_affine_weight_cpu`, which builds the
    full tensor on every rank), and perform_initialization=False skips that; they are set here
    as that path sets them (Transformer Engine layers set their own)."""
    for name, module in model.named_modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        glu = name.endswith("mlp.linear_fc1") and module.config.gated_linear_unit
        set_tensor_model_parallel_attributes(weight, True, dim, 2 if glu else 1)


def tied_in_megatron(model_cfg: ModelConfig, pctx: Any) -> bool:
    """Whether megatron itself ties the output layer (PP = 1 only; see the module docstring)."""
    return model_cfg.tie_embeddings and pctx.pp_size == 1


def apply_llama3_rope_scaling(model: GPTModel, model_cfg: ModelConfig) -> None:
    """Llama-3 frequency scaling with all four parameters. GPTModel passes only the factor to
    RotaryEmbedding (low/high frequency factors and the original context are fixed at 1, 4 and
    8192 there), so the inverse frequencies are recomputed here with megatron's own formula."""
    rope, sc = model.rotary_pos_emb, model_cfg.rope_scaling
    assert sc is not None, "build_gpt calls it for a model with rope_scaling"
    dim = model_cfg.head_dim
    base = 1.0 / (model_cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rope.inv_freq = rope._apply_scaling(
        base.to(rope.inv_freq.device), factor=sc.factor, low_freq_factor=sc.low_freq_factor,
        high_freq_factor=sc.high_freq_factor, original_max_position_embeddings=sc.original_max_position_embeddings)


# Precisions Transformer Engine's packed (THD) attention has a backend for: its flash and fused
# attention take fp16/bf16 only, and its unfused fallback (the one fp32 gets) takes no THD.
TE_DTYPES = (torch.float16, torch.bfloat16)


def local_layer_spec(model_cfg: ModelConfig):
    """megatron's local layer spec (any device); normalization: the q/k norms follow it (the
    block's own norms read config.normalization)."""
    return get_gpt_layer_local_spec(num_experts=model_cfg.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=model_cfg.qk_layernorm, normalization=model_cfg.normalization)


def te_layer_spec(model_cfg: ModelConfig):
    """megatron's Transformer Engine layer spec (CUDA and TE needed to build it)."""
    return get_gpt_layer_with_transformer_engine_spec(num_experts=model_cfg.num_experts, moe_grouped_gemm=False,
                                                      qk_layernorm=model_cfg.qk_layernorm)


def te_importable() -> bool:
    try:
        # deferred: transformer_engine needs CUDA (GPU extra)
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(model_cfg: ModelConfig, params_dtype: torch.dtype = torch.float32):
    """Transformer Engine spec when CUDA and TE are there and the model computes in fp16/bf16;
    megatron's local spec otherwise. fp32 takes the local spec: packed micro-batches (the
    default) go to TE's attention in the THD layout, which has no fp32 backend (TE_DTYPES), while
    the local spec attends packed rows through an explicit mask in any precision. LoRA always
    takes the local spec: TE fuses the layer norm into qkv/fc1, whose adapters need the normed
    input."""
    if model_cfg.lora is None and params_dtype in TE_DTYPES and cuda_present() and te_importable():
        return te_layer_spec(model_cfg)
    return local_layer_spec(model_cfg)


class ValueGPTModel(GPTModel):
    """The GPT trunk with a scalar head instead of the LM output layer (value / reward model).

    On the last pipeline stage it returns per-token values [batch, seq]; earlier stages return
    hidden states like any GPTModel stage. The head is replicated over TP ranks (its input,
    the final hidden state, is identical on every TP rank).
    """

    def __init__(self, config: TransformerConfig, num_labels: int = 1, **kwargs):
        super().__init__(config, **kwargs)
        self.num_labels = num_labels
        if self.post_process:
            del self.output_layer
            self.value_head = torch.nn.Linear(config.hidden_size, num_labels, bias=True)
            torch.nn.init.normal_(self.value_head.weight, std=config.init_method_std)
            torch.nn.init.zeros_(self.value_head.bias)

    def _postprocess(self, hidden_states, **kwargs):
        if not self.post_process:
            return hidden_states
        # [s, b, h] -> [b, s] (one label) or [b, s, num_labels] (a regression reward model)
        out = self.value_head(hidden_states)
        return (out.squeeze(-1) if self.num_labels == 1 else out).transpose(0, 1).contiguous()

    def shared_embedding_or_output_weight(self):
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # GPTModel/LanguageModule special-case output_layer, which this model does not have.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def fp32_output(module: torch.nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of a bf16 model's last stage: logits/values leave in fp32, as megatron's
    Float16Module returns them, so losses and log-probs are computed in fp32."""
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def build_gpt(model_cfg: ModelConfig, pctx: Any, *, value_head: bool = False, seed: int = 1234,
              init: bool = True, training: TrainingConfig | None = None) -> list:
    """This rank's model chunks (one chunk: its pipeline stage) on CPU, float32 (or in
    `training.precision` for a model that trains; recompute as `training` says).

    With `model_cfg.hf_path` (and no init_checkpoint, which the caller loads over the model) the
    weights come from the HF folder; a value head without an HF `score` head starts fresh.
    `init=False` leaves the weights unset, for a caller that loads every tensor itself.
    `pctx` is a ParallelContext (slurm_align.parallel.layout) or anything with tp_size, pp_size,
    is_first_stage and is_last_stage; megatron's parallel_state must already be initialised.
    Weights are drawn per tensor from (seed, global name) over the full shape, so the same
    seed gives the same model under any TP/PP layout.
    """
    apply_cpu_compat()
    seed_model_parallel(seed)
    config = transformer_config(model_cfg, pctx, training)
    cls = ValueGPTModel if value_head else GPTModel
    heads = {"num_labels": model_cfg.num_labels} if value_head else {}
    model = cls(
        config=config,
        **heads,
        transformer_layer_spec=layer_spec(model_cfg, config.params_dtype),
        vocab_size=model_cfg.padded_vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        pre_process=bool(pctx.is_first_stage),
        post_process=bool(pctx.is_last_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=tied_in_megatron(model_cfg, pctx) and not value_head,
        position_embedding_type="rope" if model_cfg.position_embedding == "rope" else "learned_absolute",
        rotary_base=model_cfg.rotary_base,
    )
    mark_tp_weights(model)
    if config.params_dtype != torch.float32:
        # megatron's Float16Module converts the whole module (the local spec's torch norms and
        # the value head are built in fp32 whatever params_dtype says), then returns fp32 outputs.
        model.to(config.params_dtype)
        if model.post_process:
            model.register_forward_hook(fp32_output)
    model.tie_embeddings = model_cfg.tie_embeddings and not value_head
    mark_tied_embedding(model, pctx)
    if model_cfg.rope_scaling is not None:
        apply_llama3_rope_scaling(model, model_cfg)
    if cuda_present():
        model = model.cuda()
    # Layout-independent init: the same seed gives the same full weights for any TP/PP.
    if init and model_cfg.hf_path is not None and model_cfg.init_checkpoint is None:
        fresh = load_hf_weights([model], pctx, model_cfg, value_head=value_head)
        init_weights([model], pctx, seed, names=fresh)
    elif init:
        init_weights([model], pctx, seed)
    return [model]


def model_device(chunks: list) -> torch.device:
    return next(chunks[0].parameters()).device
