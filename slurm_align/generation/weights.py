"""Engine-owned copies of the model's weights, refitted in place from a full state dict.

The first `load` allocates (on the engine's device) and checks names and shapes against the
contract shape; later loads copy into the same storage, so views taken once (per-layer
handles) stay valid and nothing is re-allocated. A changed key set or shape is an error, never
a silent re-allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slurm_align.generation.params import GenerationError, GptShape
from slurm_align.generation.rope import inv_freq
from slurm_align.models.te_names import local_names

EMBEDDING, POSITIONS, OUTPUT = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                                "output_layer.weight")


def expected_shapes(shape: GptShape) -> dict[str, tuple[int, ...]]:
    """Keys/shapes of the model's TP=1, PP=1 megatron state dict (local spec, no _extra_state)."""
    h, f, v, d = shape.hidden_size, shape.ffn_hidden_size, shape.padded_vocab_size, shape.head_dim
    qkv = (shape.num_attention_heads + 2 * shape.query_groups) * d
    fc1 = 2 * f if shape.activation == "swiglu" else f
    norm_bias, bias = shape.normalization == "LayerNorm", shape.add_bias_linear
    out: dict[str, tuple[int, ...]] = {EMBEDDING: (v, h), "decoder.final_layernorm.weight": (h,)}
    if shape.position_embedding == "learned":
        out[POSITIONS] = (shape.max_seq_len, h)
    if norm_bias:
        out["decoder.final_layernorm.bias"] = (h,)
    if not shape.tie_embeddings:
        out[OUTPUT] = (v, h)
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,), "input_layernorm.bias": (h,) if norm_bias else None,
            "self_attention.linear_qkv.weight": (qkv, h),
            "self_attention.linear_qkv.bias": (qkv,) if shape.qkv_bias else None,
            "self_attention.q_layernorm.weight": (d,) if shape.qk_layernorm else None,
            "self_attention.q_layernorm.bias": (d,) if shape.qk_layernorm and norm_bias else None,
            "self_attention.k_layernorm.weight": (d,) if shape.qk_layernorm else None,
            "self_attention.k_layernorm.bias": (d,) if shape.qk_layernorm and norm_bias else None,
            "self_attention.linear_proj.weight": (h, shape.num_attention_heads * d),
            "self_attention.linear_proj.bias": (h,) if bias else None,
            "pre_mlp_layernorm.weight": (h,), "pre_mlp_layernorm.bias": (h,) if norm_bias else None,
        }
        if shape.num_experts is None:
            layer.update({
                "mlp.linear_fc1.weight": (fc1, h), "mlp.linear_fc1.bias": (fc1,) if bias else None,
                "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,) if bias else None,
            })
        else:  # MoE: router + experts by global index, no biases (megatron's SequentialMLP)
            layer["mlp.router.weight"] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                layer[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (fc1, h)
                layer[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, f)
        out.update({p + k: s for k, s in layer.items() if s is not None})
    return out


def check_state_dict(sd: dict[str, torch.Tensor], shape: GptShape) -> None:
    want = expected_shapes(shape)
    got = {k for k in sd if not k.endswith("_extra_state")}
    if shape.tie_embeddings:
        got.discard(OUTPUT)  # a tied model's output layer is the embedding, whoever passes a copy
    missing, extra = sorted(set(want) - got), sorted(got - set(want))
    if missing or extra:
        raise GenerationError(f"full state dict does not match the model shape {shape}: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, s in want.items():
        if tuple(sd[k].shape) != s:
            raise GenerationError(f"full state dict: {k} has shape {tuple(sd[k].shape)}, expected {s}")


@dataclass
class LayerWeights:
    """Handles into one layer's tensors (megatron layout: qkv rows grouped per query group as
    [q_1..q_r, k, v]; fc1 rows [gate; up] for swiglu). Absent biases are None."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor | None
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    proj_w: torch.Tensor
    proj_b: torch.Tensor | None
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor | None
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor | None
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor | None
    q_norm_w: torch.Tensor | None = None   # qk_layernorm: per-head norms of q and k (head_dim)
    q_norm_b: torch.Tensor | None = None
    k_norm_w: torch.Tensor | None = None
    k_norm_b: torch.Tensor | None = None
    router_w: torch.Tensor | None = None   # MoE: [experts, hidden]; then fc1_w/fc2_w are None
    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # MoE: (fc1_w, fc2_w) per expert


class GptWeights:
    """The weights one engine computes with; `load` is the in-place refit. With rope, the
    inverse frequencies (a function of the shape only) are made with the first load."""

    def __init__(self, shape: GptShape, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.tensors: dict[str, torch.Tensor] | None = None
        self.layers: list[LayerWeights] = []
        self.inv_freq: torch.Tensor | None = None

    @property
    def loaded(self) -> bool:
        return self.tensors is not None

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor]) -> None:
        sd = local_names(sd)  # a dict named by the TE layer spec binds like the local spec's
        check_state_dict(sd, self.shape)
        if self.tensors is None:
            self.tensors = {k: sd[k].detach().to(self.device, self.dtype, copy=True).contiguous()
                            for k in expected_shapes(self.shape)}
            self._bind()
            return
        for k, dst in self.tensors.items():
            dst.copy_(sd[k].detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def free(self) -> None:
        self.tensors, self.layers, self.inv_freq = None, [], None

    def __getitem__(self, key: str) -> torch.Tensor:
        if self.tensors is None:
            raise GenerationError("the engine has no weights: call refit(full_state_dict) first")
        return self.tensors[key]

    @property
    def output(self) -> torch.Tensor:
        """The output layer's weight (the word embedding when tied)."""
        return self[EMBEDDING if self.shape.tie_embeddings else OUTPUT]

    def _bind(self) -> None:
        t, s = self.tensors, self.shape
        names = ("input_layernorm.weight", "input_layernorm.bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                 "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
                 "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                 "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
        self.layers = [LayerWeights(*(t.get(f"decoder.layers.{i}.{n}") for n in names))
                       for i in range(s.num_layers)]
        for i, lw in enumerate(self.layers):
            if s.num_experts is not None:
                p = f"decoder.layers.{i}.mlp."
                lw.router_w = t[p + "router.weight"]
                lw.experts = [(t[p + f"experts.local_experts.{e}.linear_fc1.weight"],
                               t[p + f"experts.local_experts.{e}.linear_fc2.weight"]) for e in range(s.num_experts)]
        if s.position_embedding == "rope":
            self.inv_freq = inv_freq(s.head_dim, s.rotary_base, s.rope_scaling).to(self.device)
