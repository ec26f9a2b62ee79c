"""Sequence packing and token-budget micro-batches: no compute spent on padding.

Two independent pieces, both chosen by a `Batching` (what the forward and training paths take):

- micro-batches by token budget: `balanced_partition(lengths, max_tokens)` splits the sequences
  of a batch into as few micro-batches as the budget allows (sum of sequence lengths <= budget),
  with the tokens spread evenly over them (longest first, each to the lightest micro-batch it
  fits). A sequence longer than the budget gets a micro-batch of its own: it cannot be split,
  and its memory is already bounded by the model's max_seq_len. The partition is a pure
  function of the lengths, so every TP/PP rank of a model-parallel group (which holds the same
  rows) forms the same micro-batches.
- packing: `PackedLayout` concatenates the sequences of one micro-batch into rows (first fit,
  longest first; rows as wide as the longest sequence, or a common width under pipeline
  parallelism, whose p2p buffers need one shape per step). Attention stays inside each
  sequence and positions restart at 0 per sequence: on CPU (megatron's local layer spec)
  through an explicit block-diagonal causal mask, per-row position ids (learned positions) and
  rotary angles taken at those position ids (`rope_at_positions`); with Transformer Engine
  (GPU) the rows are flattened into one THD sequence with cu_seqlens (`PackedSeqParams`), where
  TE and megatron's THD RoPE restart positions per sequence themselves.

Outputs come back to the padded layout with `PackedLayout.unpack` ([rows, width, ...] ->
[B, L, ...], differentiable), so everything downstream of the model (the sequence <-> response
mapping of rollout_batch, the losses) is the same for packed and padded micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


# -- micro-batches -----------------------------------------------------------------------------
def balanced_partition(lengths: Sequence[int] | np.ndarray | torch.Tensor, max_tokens: int) -> list[np.ndarray]:
    """Indices of each micro-batch (sorted; micro-batches in order of their first index): the
    fewest micro-batches of at most `max_tokens` tokens each (a longer sequence alone in one)
    that greedy longest-first placement finds, starting from ceil(total / budget) bins."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: a micro-batch must hold at least one token")
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not len(lengths):
        return []
    alone = np.flatnonzero(lengths > max_tokens)
    rest = np.flatnonzero(lengths <= max_tokens)
    order = rest[np.argsort(-lengths[rest], kind="stable")]   # longest first, ties by index
    k = max(-(-int(lengths[rest].sum()) // max_tokens), 1) if len(rest) else 0
    while len(rest):
        bins: list[list[int]] = [[] for _ in range(k)]
        load = np.zeros(k, dtype=np.int64)
        for i in order:
            fits = np.flatnonzero(load + lengths[i] <= max_tokens)
            if not len(fits):
                break
            b = fits[np.argmin(load[fits])]   # lightest bin that fits (first on ties)
            bins[b].append(int(i))
            load[b] += lengths[i]
        else:
            break
        k += 1
    groups = [np.sort(np.asarray(b, dtype=np.int64)) for b in bins if b] if len(rest) else []
    groups += [np.asarray([i], dtype=np.int64) for i in alone]
    return sorted(groups, key=lambda g: int(g[0]))


def count_partition(n: int, size: int) -> list[np.ndarray]:
    """Consecutive micro-batches of `size` samples (the last one may be short)."""
    return [np.arange(a, min(a + size, n), dtype=np.int64) for a in range(0, n, size)]


@dataclass(frozen=True)
class Batching:
    """How a batch of sequences becomes micro-batches.

    max_tokens: token budget of a micro-batch (sum of its sequence lengths); None: micro-batches
    of `micro_batch_size` samples (None as well: one micro-batch). pack: concatenate each
    micro-batch's sequences into rows (off: right-pad them to the longest, the ablation)."""

    micro_batch_size: int | None = None
    max_tokens: int | None = None
    pack: bool = False

    def groups(self, lengths: Sequence[int] | np.ndarray | torch.Tensor) -> list[np.ndarray]:
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if self.max_tokens is not None:
            return balanced_partition(lengths, self.max_tokens)
        return count_partition(len(lengths), self.micro_batch_size or max(len(lengths), 1))


# -- packed rows -------------------------------------------------------------------------------
@dataclass
class PackedLayout:
    """Where each sequence of a micro-batch sits in its packed rows [rows, width]."""

    lengths: torch.Tensor   # [B] int64
    row: torch.Tensor       # [B] int64
    offset: torch.Tensor    # [B] int64: first column of the sequence in its row
    rows: int
    width: int

    @classmethod
    def plan(cls, lengths: Sequence[int] | np.ndarray | torch.Tensor, width: int | None = None,
             rows: int | None = None) -> PackedLayout:
        """First fit, longest first, into rows of `width` columns (default: the longest
        sequence); at least `rows` rows (empty ones fill up to a fixed shape)."""
        lengths = torch.as_tensor(np.asarray(lengths, dtype=np.int64).reshape(-1))
        longest = int(lengths.max()) if len(lengths) else 1
        width = longest if width is None else width
        if longest > width:
            raise ValueError(f"a sequence of {longest} tokens does not fit rows of width {width}")
        fill: list[int] = []
        row = torch.zeros(len(lengths), dtype=torch.int64)
        offset = torch.zeros(len(lengths), dtype=torch.int64)
        for i in np.argsort(-lengths.numpy(), kind="stable"):
            n = int(lengths[i])
            r = next((r for r, used in enumerate(fill) if used + n <= width), None)
            if r is None:
                r = len(fill)
                fill.append(0)
            row[i], offset[i] = r, fill[r]
            fill[r] += n
        needed = max(len(fill), 1)
        if rows is not None and rows < needed:
            raise ValueError(f"{needed} rows needed, {rows} given")
        return cls(lengths, row, offset, max(needed, rows or 0), width)

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])

    def _segments(self) -> torch.Tensor:
        """[rows, width] int64: the sequence at each column, -1 - row on each row's padding tail."""
        seg = (-1 - torch.arange(self.rows)).unsqueeze(1).expand(self.rows, self.width).clone()
        for i in range(self.size):
            r, o, n = int(self.row[i]), int(self.offset[i]), int(self.lengths[i])
            seg[r, o:o + n] = i
        return seg

    def pack(self, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
        """Right-padded [B, L] token ids -> [rows, width]."""
        out = torch.full((self.rows, self.width), pad_id, dtype=tokens.dtype)
        for i in range(self.size):
            r, o, n = int(self.row[i]), int(self.offset[i]), int(self.lengths[i])
            out[r, o:o + n] = tokens[i, :n]
        return out

    def position_ids(self) -> torch.Tensor:
        """[rows, width]: 0, 1, ... within each sequence (and within each row's padding tail)."""
        seg = self._segments()
        col = torch.arange(self.width).expand(self.rows, self.width)
        start = torch.zeros_like(seg)
        for i in range(self.size):
            offset = int(self.offset[i])
            start[int(self.row[i]), offset:offset + int(self.lengths[i])] = offset
        ends = self._tail_starts()
        tail = seg < 0
        start[tail] = ends.unsqueeze(1).expand(self.rows, self.width)[tail]
        return col - start

    def _tail_starts(self) -> torch.Tensor:
        end = torch.zeros(self.rows, dtype=torch.int64)
        for i in range(self.size):
            end[int(self.row[i])] = max(int(end[int(self.row[i])]), int(self.offset[i] + self.lengths[i]))
        return end

    def attention_mask(self) -> torch.Tensor:
        """[rows, 1, width, width] bool, megatron's convention (True = masked out): causal
        within each sequence, nothing across sequences (block diagonal)."""
        seg = self._segments()
        causal = torch.ones(self.width, self.width, dtype=torch.bool).tril()
        allowed = (seg.unsqueeze(2) == seg.unsqueeze(1)) & causal
        return (~allowed).unsqueeze(1)

    def cu_seqlens(self) -> torch.Tensor:
        """int32 boundaries of every segment (sequences and padding tails) of the rows flattened
        row after row: the THD layout of Transformer Engine's packed attention."""
        bounds = [0]
        ends = self._tail_starts()
        for r in range(self.rows):
            base = r * self.width
            for i in sorted((i for i in range(self.size) if int(self.row[i]) == r), key=lambda i: int(self.offset[i])):
                bounds.append(base + int(self.offset[i] + self.lengths[i]))
            if int(ends[r]) < self.width:
                bounds.append(base + self.width)
        return torch.tensor(bounds, dtype=torch.int32)

    def max_segment(self) -> int:
        cu = self.cu_seqlens()
        return int((cu[1:] - cu[:-1]).max())

    def unpack(self, per_position: torch.Tensor, width: int, drop_last: int = 0) -> torch.Tensor:
        """[rows, W', ...] per packed position -> [B, width, ...] per sequence position; column
        p of sequence i is kept for p < length_i - drop_last and 0 elsewhere (drop_last=1 for
        next-token log-probs, whose last position would predict the next sequence's token).
        Differentiable (a gather)."""
        col = torch.arange(width).unsqueeze(0)
        valid = col < (self.lengths - drop_last).unsqueeze(1)
        src_col = (self.offset.unsqueeze(1) + col).clamp(max=per_position.shape[1] - 1)
        src_row = self.row.unsqueeze(1).expand_as(src_col)
        dev = per_position.device
        out = per_position[src_row.to(dev), src_col.to(dev)]
        shape = valid.shape + (1,) * (out.dim() - 2)
        return out * valid.reshape(shape).to(device=dev, dtype=out.dtype)


# -- model inputs ------------------------------------------------------------------------------
def rope_angles(rope: RotaryEmbedding, position_ids: torch.Tensor) -> torch.Tensor:
    """megatron's rotary embedding [s, b, 1, dim] for per-row positions [b, s] (its own is
    [s, 1, 1, dim] for positions 0..s-1 in every row); the same angles as
    RotaryEmbedding.get_emb at equal positions (position x inv_freq, halves repeated)."""
    inv = rope.inv_freq
    pos = position_ids.t().to(device=inv.device, dtype=inv.dtype)
    if getattr(rope, "seq_len_interpolation_factor", None) is not None:
        pos = pos * (1 / rope.seq_len_interpolation_factor)
    freqs = pos.unsqueeze(-1) * inv                        # [s, b, dim/2]
    if getattr(rope, "rotary_interleaved", False):
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.unsqueeze(2)


@contextlib.contextmanager
def rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """Within the block, `model`'s rotary embedding (if it has one) gives the angles of
    `position_ids` instead of those of each row's column index: positions restart per packed
    sequence. The instance's forward is shadowed and restored (nothing else changes)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or getattr(model, "position_embedding_type", None) != "rope":
        yield
        return
    emb = rope_angles(rope, position_ids)
    rope.forward = lambda *args, **kwargs: emb
    try:
        yield
    finally:
        del rope.forward


# -- micro-batch inputs --------------------------------------------------------------------------
def micro_batch_inputs(tokens: torch.Tensor, lengths: torch.Tensor, groups: list[np.ndarray], *, pack: bool,
                       fixed_shape: bool) -> list[dict]:
    """The model input of each micro-batch (`groups`: indices into the right-padded
    tokens [B, L] with `lengths` [B]): {"tokens", "rows" (the batch rows it holds), "real"
    ([len(rows)] float, 0 on filler rows)}, plus "packing" (its PackedLayout) when packed.

    Padded: rows as they are (width L); with `fixed_shape` (pipeline parallelism: one p2p
    shape per step) every micro-batch has as many rows as the largest, filled up with copies of
    its last row (real 0). Packed: rows as wide as the micro-batch's longest sequence; with
    `fixed_shape` every micro-batch has the batch's longest width and the most rows of any
    (empty rows fill up)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    out: list[dict] = []
    if not pack:
        size = max(len(g) for g in groups) if fixed_shape and groups else None
        for g in groups:
            rows = torch.as_tensor(g, dtype=torch.int64)
            real = torch.ones(len(rows))
            if size is not None and len(rows) < size:
                real = torch.cat([real, torch.zeros(size - len(rows))])
                rows = torch.cat([rows, rows[-1:].expand(size - len(rows))])
            out.append({"tokens": tokens[rows], "rows": rows, "real": real})
        return out
    width = int(lengths.max()) if fixed_shape and len(lengths) else None
    layouts = [PackedLayout.plan(lengths[torch.as_tensor(g)], width=width) for g in groups]
    n_rows = max((lay.rows for lay in layouts), default=1) if fixed_shape else None
    for g, lay in zip(groups, layouts):
        if n_rows is not None and lay.rows < n_rows:
            lay = PackedLayout(lay.lengths, lay.row, lay.offset, n_rows, lay.width)
        rows = torch.as_tensor(g, dtype=torch.int64)
        out.append({"tokens": lay.pack(tokens[rows], 0), "rows": rows, "real": torch.ones(len(rows)),
                    "packing": lay})
    return out


def run_batching(run, component: str = "actor", micro_batch_size: int | None = None, *,
                 sequences_per_item: int = 1) -> Batching:
    """The Batching of a component ("actor" or "critic") of a RunConfig: its token budget
    (default micro_batch_size x sequences_per_item x max_seq_len, the sample count's worst
    case) when switches.token_budget_micro_batches is on, packed when switches.sequence_packing
    is on."""
    sw = run.switches
    max_tokens = None
    if sw.token_budget_micro_batches:
        max_tokens = getattr(run, component).max_tokens_per_micro_batch
        if max_tokens is None and micro_batch_size is not None:
            model = run.model if component == "actor" else (run.critic_model or run.model)
            max_tokens = micro_batch_size * sequences_per_item * model.max_seq_len
    return Batching(micro_batch_size=micro_batch_size, max_tokens=max_tokens, pack=sw.sequence_packing)
