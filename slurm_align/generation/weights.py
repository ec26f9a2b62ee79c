"""Engine-owned copies of the GPT weights, refitted in place from a full state dict.

The first `load` allocates (on the engine's device) and checks names and shapes against the
contract shape; later loads copy into the same storage, so views taken once (per-layer
handles) stay valid and nothing is re-allocated. A changed key set or shape is an error, never
a silent re-allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slurm_align.generation.params import GenerationError, GptShape
from slurm_align.models.te_names import local_names


def expected_shapes(shape: GptShape) -> dict[str, tuple[int, ...]]:
    """Keys/shapes of the contract model's TP=1, PP=1 megatron state dict (no _extra_state)."""
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.padded_vocab_size
    out: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (v, h),
        "embedding.position_embeddings.weight": (shape.max_seq_len, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.final_layernorm.bias": (h,),
        "output_layer.weight": (v, h),
    }
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "input_layernorm.bias": (h,),
            p + "self_attention.linear_qkv.weight": (3 * h, h),
            p + "self_attention.linear_qkv.bias": (3 * h,),
            p + "self_attention.linear_proj.weight": (h, h),
            p + "self_attention.linear_proj.bias": (h,),
            p + "pre_mlp_layernorm.weight": (h,), p + "pre_mlp_layernorm.bias": (h,),
            p + "mlp.linear_fc1.weight": (f, h), p + "mlp.linear_fc1.bias": (f,),
            p + "mlp.linear_fc2.weight": (h, f), p + "mlp.linear_fc2.bias": (h,),
        })
    return out


def check_state_dict(sd: dict[str, torch.Tensor], shape: GptShape) -> None:
    want = expected_shapes(shape)
    got = {k for k in sd if not k.endswith("_extra_state")}
    missing, extra = sorted(set(want) - got), sorted(got - set(want))
    if missing or extra:
        raise GenerationError(f"full state dict does not match the model shape {shape}: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, s in want.items():
        if tuple(sd[k].shape) != s:
            raise GenerationError(f"full state dict: {k} has shape {tuple(sd[k].shape)}, expected {s}")


@dataclass
class LayerWeights:
    """Handles into one layer's tensors (megatron layout: qkv rows grouped per head as [q, k, v])."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


class GptWeights:
    """The weights one engine computes with; `load` is the in-place refit."""

    def __init__(self, shape: GptShape, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        self.tensors: dict[str, torch.Tensor] | None = None
        self.layers: list[LayerWeights] = []

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
            self._bind_layers()
            return
        for k, dst in self.tensors.items():
            dst.copy_(sd[k].detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def free(self) -> None:
        self.tensors, self.layers = None, []

    def __getitem__(self, key: str) -> torch.Tensor:
        if self.tensors is None:
            raise GenerationError("the engine has no weights: call refit(full_state_dict) first")
        return self.tensors[key]

    def _bind_layers(self) -> None:
        t = self.tensors
        names = ("input_layernorm.weight", "input_layernorm.bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                 "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
        self.layers = [LayerWeights(*(t[f"decoder.layers.{i}.{n}"] for n in names))
                       for i in range(self.shape.num_layers)]
