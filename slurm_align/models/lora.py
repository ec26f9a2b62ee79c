"""LoRA on megatron-core's linear layers: y = W x + (alpha / r) * B(A(dropout(x))).

Adapters are attached to a built (and loaded) model by `attach_lora`, as forward hooks on the
target layers (qkv, proj, fc1, fc2 of every transformer layer). They are kept OUT of the
chunks' module tree (`chunk.lora`, not a registered submodule): the chunks' parameters, state
dict and sharded state dict stay the base model's, so HostSwap, full_state_dict, the HF import
and `load_weights` of a base checkpoint see exactly the model without LoRA. The base weights
are frozen (megatron's linear layers then take their frozen-weight path).

TP-aware shapes (h = A x is the rank-r bottleneck):
- column-parallel (qkv, fc1; output split over TP): A [r, in] replicated, B [out/TP, r] split
  on dim 0; h's gradient is summed over TP (megatron's copy_to_tensor_model_parallel_region),
  so A and x get the full gradient on every rank. SwiGLU fc1 has two B's (gate, up), each split
  like its half of the weight, so a checkpoint reshards between TP sizes.
- row-parallel (proj, fc2; input split over TP): A [r, in/TP] split on dim 1, h summed over TP
  (reduce_from_tensor_model_parallel_region), B [out, r] replicated.
Adapter names are the target weight's global name without `.weight` (weights.py naming), plus
`.lora_A` / `.lora_B` (`.lora_B_gate`, `.lora_B_up` for SwiGLU fc1).

The reference policy of a LoRA run is the same model with the adapters off (`AdaptersOff`,
swap() like HostSwap); the engine refit and the merged export use `merged`, which lends the
target layers W + scale * B A for the duration of a with-block and gives the untouched base
tensors back afterwards (bit-identical).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from slurm_align.config.run import LoraConfig, ModelConfig
from slurm_align.models.weights import HostSwap, global_name, layer_offset

# target -> module name suffix inside a transformer layer
TARGET_MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
                  "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


class LoraLinear(torch.nn.Module):
    """One layer's adapter (this TP rank's shards) and the forward hook that adds it."""

    # B, registered by name (b_names): lora_B, or lora_B_gate and lora_B_up for SwiGLU's fc1
    lora_B: torch.nn.Parameter
    lora_B_gate: torch.nn.Parameter
    lora_B_up: torch.nn.Parameter

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, name: str, cfg: LoraConfig, seed: int,
                 glu: bool):
        super().__init__()
        self.name, self.scale, self.enabled = name, cfg.alpha / cfg.rank, True
        self.column = isinstance(layer, ColumnParallelLinear)
        if not self.column and not isinstance(layer, RowParallelLinear):
            raise TypeError(f"{name}: LoRA needs megatron's local-spec linear layers, got {type(layer).__name__}")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        out_local, in_local = layer.weight.shape
        full_in = in_local if self.column else in_local * tp
        device, r = layer.weight.device, cfg.rank
        # A as PEFT draws it (kaiming-uniform, a=sqrt(5): U(+-1/sqrt(in))), from (seed, name)
        # over the full shape, so every TP/DP layout starts from the same adapters.
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        a = (torch.rand(r, full_in, generator=g) * 2 - 1) / full_in ** 0.5
        if not self.column:
            a = a.chunk(tp, dim=1)[tp_rank]
        self.lora_A = torch.nn.Parameter(a.contiguous().to(device))
        if self.column:
            mark_tp(self.lora_A, None)
        else:
            mark_tp(self.lora_A, 1)
        parts = ("gate", "up") if glu else ("",)
        self.b_names = [f"lora_B_{p}" if p else "lora_B" for p in parts]
        for b in self.b_names:
            param = torch.nn.Parameter(torch.zeros(out_local // len(parts), r, device=device))
            mark_tp(param, 0 if self.column else None)
            self.register_parameter(b, param)
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        self.layer = [layer]   # a list: not a submodule (the base stays out of this tree)
        self.handle = layer.register_forward_hook(self._hook)

    def b_matrix(self) -> torch.Tensor:
        """B of this rank in the layer's local output layout ([gate_r; up_r] for SwiGLU fc1)."""
        return torch.cat([getattr(self, b) for b in self.b_names], dim=0)

    def delta(self) -> torch.Tensor:
        """scale * B A in the layer weight's local shape."""
        return self.scale * (self.b_matrix() @ self.lora_A)

    def _hook(self, layer, args, output):
        if not self.enabled:
            return output
        x, (out, bias) = args[0], output   # megatron's linear layers take the input positionally
        self.dropout.train(layer.training)
        # The adapters stay fp32 in a bf16/fp16 model (they are what trains; their optimizer
        # state is small): the bottleneck runs in the adapters' dtype, its sum in the layer's.
        h = torch.nn.functional.linear(self.dropout(x.to(self.lora_A.dtype)), self.lora_A)
        # column: gradient of h summed over TP; row: h itself summed over TP
        h = copy_to_tensor_model_parallel_region(h) if self.column else reduce_from_tensor_model_parallel_region(h)
        return out + (self.scale * torch.nn.functional.linear(h, self.b_matrix())).to(out.dtype), bias


def mark_tp(param: torch.Tensor, dim: int | None) -> None:
    """megatron's TP attributes: the gradient norm counts a split tensor on every TP rank and a
    replicated one once (models.optimizer.reduce_gradients). Attributes megatron reads off a
    parameter, which torch's Tensor type does not declare."""
    param.tensor_model_parallel = dim is not None  # type: ignore[attr-defined]
    param.partition_dim = -1 if dim is None else dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


class LoraAdapters(torch.nn.Module):
    """Every adapter of one chunk, by global name."""

    def __init__(self, layers: dict[str, LoraLinear]):
        super().__init__()
        self.names = list(layers)
        self.layers = torch.nn.ModuleList(layers.values())

    def items(self) -> Iterator[tuple[str, LoraLinear]]:
        # a ModuleList's items are typed Module; __init__ filled it with LoraLinear only
        return cast(Iterator[tuple[str, LoraLinear]], zip(self.names, self.layers))


def attach_lora(chunks: list, cfg: LoraConfig, pctx: Any, seed: int) -> None:
    """Adapters on every target layer of every chunk; freezes the base weights. Call it after
    the base weights are loaded (build_gpt + load_weights)."""
    for chunk in chunks:
        if getattr(chunk, "lora", None) is not None:
            raise RuntimeError("LoRA adapters are attached already")
        for p in chunk.parameters():
            p.requires_grad_(False)
        offset, layers = layer_offset(chunk, pctx), {}
        suffixes = {TARGET_MODULES[t]: t for t in cfg.targets}
        for name, module in chunk.named_modules():
            target = next((t for s, t in suffixes.items() if name.endswith("." + s)), None)
            if target is None or not name.startswith("decoder.layers."):
                continue
            full = global_name(name + ".weight", offset)[: -len(".weight")]
            glu = target == "fc1" and chunk.config.gated_linear_unit
            layers[full] = LoraLinear(module, full, cfg, seed, glu)
        object.__setattr__(chunk, "lora", LoraAdapters(layers))   # not registered: see the docstring


def has_lora(chunks: list) -> bool:
    return getattr(chunks[0], "lora", None) is not None


def adapters(chunks: list) -> Iterator[tuple[str, LoraLinear]]:
    for chunk in chunks:
        if getattr(chunk, "lora", None) is not None:
            yield from chunk.lora.items()


def trainable_parameters(chunks: list) -> list[torch.nn.Parameter]:
    """What the optimizer holds: the adapters of a LoRA model, every parameter otherwise."""
    if has_lora(chunks):
        return [p for _, a in adapters(chunks) for p in a.parameters()]
    return [p for c in chunks for p in c.parameters()]


def adapter_tensors(chunks: list) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global adapter name, this rank's shard) of every adapter tensor."""
    for name, a in adapters(chunks):
        for pname in ["lora_A", *a.b_names]:
            yield f"{name}.{pname}", getattr(a, pname)


def sharded_adapter_state(chunks: list) -> dict:
    """dist_checkpointing's sharded state of the adapters (the parameters themselves, so the
    optimizer state maps onto them): split tensors by TP rank, replicated ones once."""
    out = {}
    for key, p in adapter_tensors(chunks):
        if p.tensor_model_parallel:  # type: ignore[attr-defined]  # set by mark_tp
            out[key] = make_tp_sharded_tensor_for_checkpoint(p, key, p.partition_dim)  # type: ignore[attr-defined]
        else:
            out[key] = make_sharded_tensor_for_checkpoint(p, key)
    return out


class AdaptersOff:
    """The reference policy of a LoRA model: the same model with its adapters off. swap()
    toggles, as HostSwap.swap() exchanges actor and reference weights."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def swap(self) -> None:
        for _, a in adapters(self.chunks):
            a.enabled = not a.enabled


def reference_policy(chunks: list) -> AdaptersOff | HostSwap:
    """The frozen initial policy: adapters off for a LoRA model, a host copy of the weights otherwise."""
    return AdaptersOff(chunks) if has_lora(chunks) else HostSwap(chunks)


@contextmanager
@torch.no_grad()
def merged(chunks: list):
    """Inside the block, the target layers' weights are W + scale * B A (this rank's shards),
    for a refit or an export; afterwards the base tensors themselves are back. The hooks stay
    on: a forward pass inside the block needs the adapters off (AdaptersOff) or counts B A twice."""
    saved = []
    try:
        for _, a in adapters(chunks):
            layer = a.layer[0]
            saved.append((layer, layer.weight.data))
            layer.weight.data = layer.weight.data + a.delta().to(layer.weight.dtype)
        yield
    finally:
        for layer, data in saved:
            layer.weight.data = data


def attach_configured(chunks: list, model_cfg: ModelConfig, pctx: Any, seed: int) -> None:
    """attach_lora when model.lora is set (after the base weights are in), nothing otherwise."""
    if model_cfg.lora is not None:
        attach_lora(chunks, model_cfg.lora, pctx, seed)


def lora_base(model_cfg: ModelConfig, seed: int, init_checkpoint: str | Path | None = None) -> dict:
    """The reference to the base a LoRA checkpoint's adapters belong to (its common state):
    the init checkpoint or HF folder the base weights came from, or the seed they were drawn
    with. Empty without LoRA."""
    if model_cfg.lora is None:
        return {}
    ckpt = init_checkpoint or model_cfg.init_checkpoint
    return {"lora_base": {"init_checkpoint": str(ckpt) if ckpt else None,
                          "hf_path": str(model_cfg.hf_path) if model_cfg.hf_path and not ckpt else None,
                          "seed": seed}}
