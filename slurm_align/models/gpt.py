"""megatron-core GPTModel builders: the policy/reference LM and the value/reward model.

Every model follows the shared architecture contract (see ../shared/DESIGN.md and the models
issue): a GPTModel with learned absolute positions, LayerNorm, GELU, biases, no dropout,
untied output layer; Transformer Engine layer spec when CUDA and TE are present, the local spec
otherwise. `build_gpt` returns a list of model chunks (one: this rank's pipeline stage).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from slurm_align.config.run import ModelConfig
from slurm_align.models.cpu_compat import apply_cpu_compat, cuda_present, seed_model_parallel


def transformer_config(model_cfg: ModelConfig, pctx: Any) -> TransformerConfig:
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        ffn_hidden_size=model_cfg.ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=True,
        activation_func=torch.nn.functional.gelu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        init_method_std=0.02,
        tensor_model_parallel_size=pctx.tp_size,
        pipeline_model_parallel_size=pctx.pp_size,
        # The PP schedule needs to know the activation dtype for its p2p buffers.
        pipeline_dtype=torch.float32,
    )


def layer_spec():
    """Transformer Engine spec when CUDA and TE are importable, megatron's local spec otherwise."""
    if cuda_present():
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
            import transformer_engine  # noqa: F401
            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec()


class ValueGPTModel(GPTModel):
    """The GPT trunk with a scalar head instead of the LM output layer (value / reward model).

    On the last pipeline stage it returns per-token values [batch, seq]; earlier stages return
    hidden states like any GPTModel stage. The head is replicated over TP ranks (its input,
    the final hidden state, is identical on every TP rank).
    """

    def __init__(self, config: TransformerConfig, **kwargs):
        super().__init__(config, **kwargs)
        if self.post_process:
            del self.output_layer
            self.value_head = torch.nn.Linear(config.hidden_size, 1, bias=True)
            torch.nn.init.normal_(self.value_head.weight, std=config.init_method_std)
            torch.nn.init.zeros_(self.value_head.bias)

    def _postprocess(self, hidden_states, **kwargs):
        if not self.post_process:
            return hidden_states
        # [s, b, h] -> [b, s]
        return self.value_head(hidden_states).squeeze(-1).transpose(0, 1).contiguous()

    def shared_embedding_or_output_weight(self):
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        # GPTModel/LanguageModule special-case output_layer, which this model does not have.
        from megatron.core.transformer.module import MegatronModule
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)


def build_gpt(model_cfg: ModelConfig, pctx: Any, *, value_head: bool = False, seed: int = 1234) -> list:
    """This rank's model chunks (one chunk: its pipeline stage) on CPU, float32.

    `pctx` is a ParallelContext (slurm_align.parallel.layout) or anything with tp_size, pp_size,
    is_first_stage and is_last_stage; megatron's parallel_state must already be initialised.
    Weights are drawn per tensor from (seed, global name) over the full shape, so the same
    seed gives the same model under any TP/PP layout.
    """
    apply_cpu_compat()
    seed_model_parallel(seed)
    config = transformer_config(model_cfg, pctx)
    cls = ValueGPTModel if value_head else GPTModel
    model = cls(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=model_cfg.padded_vocab_size,
        max_sequence_length=model_cfg.max_seq_len,
        pre_process=bool(pctx.is_first_stage),
        post_process=bool(pctx.is_last_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    )
    if cuda_present():
        model = model.cuda()
    # Layout-independent init: the same seed gives the same full weights for any TP/PP.
    from slurm_align.models.weights import init_weights
    init_weights([model], pctx, seed)
    return [model]


def model_device(chunks: list) -> torch.device:
    return next(chunks[0].parameters()).device
