"""Transformer Engine layer spec names <-> megatron's local spec names (one table, both ways).

With TE present (GPUs), models/gpt.py builds layers from
`get_gpt_layer_with_transformer_engine_spec()`. That spec fuses each pre-norm into the linear
that follows it (TELayerNormColumnParallelLinear), so megatron-core 0.16.1 names the norms

    decoder.layers.N.self_attention.linear_qkv.layer_norm_weight / layer_norm_bias
    decoder.layers.N.mlp.linear_fc1.layer_norm_weight / layer_norm_bias

where the local spec has `input_layernorm.*` and `pre_mlp_layernorm.*` (its own modules are
IdentityOp without parameters there). Everything else (linear weights and biases, the final
norm, embeddings, output layer) is named alike. The project's shared naming (full state dicts,
generation engines, HF mapping) is the local spec's: `local_name` is applied where names
leave a model (models/weights.local_tensors), so init, full_state_dict, load_full_state_dict
and the engines see one naming whichever spec built the model.
"""

from __future__ import annotations

import re

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_TO_LOCAL.items()}
_LAYER = re.compile(r"^(.*?layers\.\d+\.)(.+)$")


def _translate(name: str, table: dict[str, str]) -> str:
    m = _LAYER.match(name)
    if m is None or m.group(2) not in table:
        return name
    return m.group(1) + table[m.group(2)]


def local_name(name: str) -> str:
    """The local spec's name of a parameter named by either spec (unchanged when already local)."""
    return _translate(name, _TE_TO_LOCAL)


def te_name(name: str) -> str:
    """The TE spec's name of a parameter named by either spec (unchanged when already TE)."""
    return _translate(name, _LOCAL_TO_TE)


def local_names(state: dict) -> dict:
    """A state dict with local spec keys (same tensors, same order)."""
    return {local_name(k): v for k, v in state.items()}
