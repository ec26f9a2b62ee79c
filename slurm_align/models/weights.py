"""Full (TP-gathered, PP-collected) weights in the shared naming, their inverse, and host swap.

Naming: exactly the state_dict keys of the same model built with TP=1, PP=1 (global layer index
in `decoder.layers.N.*`, `_extra_state` dropped), float32 on CPU.

Layouts that TP splits in a non-contiguous way:
- SwiGLU fc1 (weight and bias) is [gate; up] in the full tensor, and each TP rank holds
  [gate_r; up_r] (megatron's layout): split and joined per half.
- GQA QKV is grouped per key/value head ([q.., k, v] per group) and TP divides the groups, so a
  plain split along dim 0 is right.
- Tied embeddings (no output_layer.weight in the full dict): with PP > 1 the last stage holds a
  copy of the embedding as output_layer.weight (see gpt.py), loaded and initialised from the
  embedding's values; `sync_tied_embedding_grads` (called by the trainers' gradient reduction)
  sums its gradient with the embedding's.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from slurm_align.models.te_names import local_name

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def layer_offset(chunk: GPTModel, pctx: Any) -> int:
    """Global index of this stage's first transformer layer (layers split evenly over PP)."""
    return pctx.pp_rank * (chunk.config.num_layers // pctx.pp_size)


def expert_offset(chunk: GPTModel, pctx: Any) -> int:
    """Global index of this rank's first expert (MoE: experts split evenly over EP)."""
    experts = getattr(chunk.config, "num_moe_experts", None)
    ep = getattr(pctx, "ep_size", 1)
    return 0 if not experts else getattr(pctx, "ep_rank", 0) * (experts // ep)


def global_name(local: str, offset: int, experts: int = 0) -> str:
    """The TP=1, PP=1, EP=1 name: layer index + `offset`, local expert index + `experts`."""
    m = _LAYER.match(local)
    name = f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else local
    e = _EXPERT.match(name)
    return f"{e.group(1)}{int(e.group(2)) + experts}{e.group(3)}" if e else name


def is_expert(name: str) -> bool:
    """A routed expert's tensor (held by one EP rank, not replicated over DP)."""
    return _EXPERT.match(name) is not None


def local_tensors(chunks: list, pctx: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, this rank's shard) for every tensor of the chunks, `_extra_state` skipped."""
    for chunk in chunks:
        offset, experts = layer_offset(chunk, pctx), expert_offset(chunk, pctx)
        for name, t in chunk.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                continue
            yield local_name(global_name(name, offset, experts)), t  # TE spec names -> local spec's


def _tp_partition_dim(t: torch.Tensor) -> int | None:
    # partition_dim: set on a TP-split parameter by megatron (or mark_tp), not a torch attribute
    return t.partition_dim if getattr(t, "tensor_model_parallel", False) else None  # type: ignore[attr-defined]


def _is_glu_fc1(name: str, chunk: GPTModel) -> bool:
    return chunk.config.gated_linear_unit and ".mlp.linear_fc1." in name


def tied_copy(name: str, chunk: GPTModel) -> bool:
    """The last stage's copy of a tied embedding (PP > 1): not part of the full dict."""
    return name == OUTPUT and getattr(chunk, "tie_embeddings", False)


def tp_shard(full: torch.Tensor, dim: int | None, tp_size: int, tp_rank: int, glu: bool) -> torch.Tensor:
    """This TP rank's slice of a full tensor (the inverse of tp_join)."""
    if dim is None or tp_size == 1:
        return full
    if glu:
        return torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in full.chunk(2, dim=0)], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_join(parts: list[torch.Tensor], dim: int, glu: bool) -> torch.Tensor:
    """The full tensor from every TP rank's slice, in TP rank order."""
    if glu:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def _gather_tp(t: torch.Tensor, pctx: Any, glu: bool = False) -> torch.Tensor:
    dim = _tp_partition_dim(t)
    data = t.detach().float().contiguous()  # gathered on the parameter's device (NCCL needs it)
    if dim is None or pctx.tp_size == 1:
        return data.cpu().clone()
    parts = [torch.empty_like(data) for _ in range(pctx.tp_size)]
    dist.all_gather(parts, data, group=pctx.tp_group)
    return tp_join(parts, dim, glu).cpu()


@torch.no_grad()
def full_state_dict(chunks: list, pctx: Any, *, to_all: bool = True) -> dict[str, torch.Tensor] | None:
    """The model's full weights. Collective over the model-parallel group (TP all-gather along
    each parameter's partition_dim, then the PP stages' dicts exchanged).

    `to_all=True`: every rank gets the dict. `to_all=False`: only the first PP stage's ranks
    (in particular global rank 0) get it, the rest get None (less memory on later stages).
    Keys are ordered as in the TP=1, PP=1 model.
    """
    mine = {name: _gather_tp(t, pctx, _is_glu_fc1(name, chunk))
            for chunk in chunks for name, t in local_tensors([chunk], pctx) if not tied_copy(name, chunk)}
    if getattr(pctx, "ep_size", 1) > 1:
        # every EP peer holds other experts of the same layers: collect them in module order
        peers: list = [None] * pctx.ep_size
        dist.all_gather_object(peers, {k: v for k, v in mine.items() if is_expert(k)}, group=pctx.ep_group)
        mine = _merge_experts(mine, peers)
    if pctx.pp_size == 1:
        return mine
    stages: list = [None] * pctx.pp_size
    if to_all:
        dist.all_gather_object(stages, mine, group=pctx.pp_group)
    else:
        dst = dist.get_global_rank(pctx.pp_group, 0)
        dist.gather_object(mine, stages if pctx.pp_rank == 0 else None, dst=dst, group=pctx.pp_group)
        if pctx.pp_rank != 0:
            return None
    full: dict[str, torch.Tensor] = {}
    for stage in stages:  # stage order = module order of the TP=1, PP=1 model
        full.update(stage)
    return full


def _by_expert_index(name: str) -> tuple[int, str]:
    m = _EXPERT.match(name)
    assert m is not None, f"{name} is not an expert's tensor"
    return int(m.group(2)), name


def _merge_experts(mine: dict[str, torch.Tensor], peers: list[dict]) -> dict[str, torch.Tensor]:
    """`mine` with every EP peer's experts, ordered as the EP=1 model (experts by global index
    within each layer's place)."""
    experts = {k: v for peer in peers for k, v in peer.items()}
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for k, v in mine.items():
        m = _EXPERT.match(k)
        if m is None:   # not an expert's tensor
            out[k] = v
            continue
        layer = m.group(1)
        if layer in done:
            continue
        done.add(layer)
        ours = sorted((n for n in experts if n.startswith(layer)), key=_by_expert_index)
        out.update({n: experts[n] for n in ours})
    return out


@torch.no_grad()
def load_full_state_dict(chunks: list, pctx: Any, full: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict into this rank's TP/PP shards (no communication). Every local
    tensor must be present with the full shape; extra keys (other stages') are ignored."""
    problems = []
    for chunk in chunks:
        for name, t in local_tensors([chunk], pctx):
            key = EMBEDDING if tied_copy(name, chunk) else name
            if key not in full:
                problems.append(f"missing key {key}")
                continue
            _copy_shard(t, full[key], name, chunk, pctx, problems)
    if problems:
        raise ValueError("load_full_state_dict: " + "; ".join(problems[:10]))


def _copy_shard(t: torch.Tensor, src: torch.Tensor, name: str, chunk, pctx: Any, problems: list) -> None:
    dim = _tp_partition_dim(t)
    if dim is not None and pctx.tp_size > 1:
        if src.shape[dim] != t.shape[dim] * pctx.tp_size:
            problems.append(f"{name}: full shape {tuple(src.shape)} does not split into "
                            f"{pctx.tp_size} x {tuple(t.shape)} along dim {dim}")
            return
        src = tp_shard(src, dim, pctx.tp_size, pctx.tp_rank, _is_glu_fc1(name, chunk))
    if src.shape != t.shape:
        problems.append(f"{name}: full shape {tuple(src.shape)} != local shape {tuple(t.shape)}")
        return
    t.copy_(src.to(t.dtype))


def mark_tied_embedding(chunk: GPTModel, pctx: Any) -> None:
    """Tied embeddings with PP > 1: flag the embedding (first stage) and its copy (last stage)
    for sync_tied_embedding_grads; the copy is also left out of the gradient norm."""
    if pctx.pp_size == 1 or not getattr(chunk, "tie_embeddings", False):
        return
    if pctx.is_first_stage:
        chunk.embedding.word_embeddings.weight.tied_embedding = True
    if pctx.is_last_stage:
        chunk.output_layer.weight.tied_embedding = True
        chunk.output_layer.weight.tied_copy = True


@torch.no_grad()
def sync_tied_embedding_grads(params: list) -> None:
    """Sum the gradients of a tied embedding and its last-stage copy over megatron's embedding
    group (first and last stage), so both copies take the same step. Parameters come flagged
    by mark_tied_embedding; without any, nothing happens (no collective)."""
    for p in params:
        if getattr(p, "tied_embedding", False):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=parallel_state.get_embedding_group())


class HostSwap:
    """Host-memory copies of a model's parameters, allocated once (pinned when CUDA is there).

    - `stash()`: model -> host; `restore()`: host -> model (the model keeps its device memory);
    - `swap()`: exchange model and host contents in place (actor <-> reference in one model),
      through one scratch buffer allocated once;
    - `offload()` / `onload()`: free the model's device memory and bring it back (reward <-> value
      on a GPU); on CPU the parameters already live in host memory, so these copy nothing.
    """

    def __init__(self, chunks: list, *, copy_now: bool = True):
        self.params = [p for chunk in chunks for p in chunk.parameters()]
        pin = torch.cuda.is_available()
        self.host = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin) for p in self.params]
        largest = max(p.numel() for p in self.params)
        self._scratch = torch.empty(largest, dtype=self.params[0].dtype, device=self.params[0].device)
        self.offloaded = False
        if copy_now:
            self.stash()

    @torch.no_grad()
    def stash(self) -> None:
        for p, h in zip(self.params, self.host):
            h.copy_(p.data, non_blocking=True)
        self._sync()

    @torch.no_grad()
    def restore(self) -> None:
        for p, h in zip(self.params, self.host):
            p.data.copy_(h, non_blocking=True)
        self._sync()

    @torch.no_grad()
    def swap(self) -> None:
        for p, h in zip(self.params, self.host):
            tmp = self._scratch[: p.numel()].view_as(p.data)
            tmp.copy_(p.data)
            p.data.copy_(h, non_blocking=True)
            h.copy_(tmp, non_blocking=True)
            self._sync()  # tmp is reused by the next parameter

    @torch.no_grad()
    def offload(self) -> None:
        if self.offloaded:
            return
        self.stash()
        if self.params[0].device.type != "cpu":
            for p in self.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.offloaded = True

    @torch.no_grad()
    def onload(self) -> None:
        if not self.offloaded:
            return
        for p, h in zip(self.params, self.host):
            if p.data.numel() != h.numel():
                p.data = torch.empty(h.shape, dtype=h.dtype, device=p.device)
            p.data.copy_(h, non_blocking=True)
        self._sync()
        self.offloaded = False

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _init_std(name: str, std: float, num_layers: int) -> float | None:
    """megatron's init: normal(std) for weights, std/sqrt(2L) for the layers that write into
    the residual stream, LayerNorm to (1, 0), biases 0. None means 'not a random tensor'."""
    if name.endswith("bias"):
        return None
    if "layernorm" in name:  # both LayerNorm and RMSNorm weights
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return std / (2.0 * num_layers) ** 0.5
    return std


@torch.no_grad()
def init_weights(chunks: list, pctx: Any, seed: int, names: set[str] | None = None) -> None:
    """Initialise every tensor (or those in `names`) from a generator seeded by (seed, global
    name) over its FULL shape, then keep this rank's shard: the same seed gives the same model
    for any TP/PP."""
    for chunk in chunks:
        std, num_layers = chunk.config.init_method_std, chunk.config.num_layers
        for name, t in local_tensors([chunk], pctx):
            if names is not None and name not in names:
                continue
            if name.endswith("weight") and "layernorm" in name:
                t.fill_(1.0)
                continue
            if tied_copy(name, chunk):
                name = EMBEDDING  # the same values as the first stage's embedding
            s = _init_std(name, std, num_layers)
            if s is None:
                t.zero_()
                continue
            dim = _tp_partition_dim(t)
            shape = list(t.shape)
            if dim is not None:
                shape[dim] *= pctx.tp_size
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=g, dtype=torch.float32) * s
            t.copy_(tp_shard(full, dim, pctx.tp_size, pctx.tp_rank, _is_glu_fc1(name, chunk)).to(t.dtype))
