"""One step's rollouts as columns: the actor's single data path from generation to training.

A RolloutBatch of B samples holds
    tokens            [B, L] int64: prompt then response, right-padded with pad_id
    prompt_lengths    [B] int64 (BOS included), response_lengths [B] int64
    samples           per-sample columns [B]: index (unique within the step), group (the prompt's
                      group: GRPO's samples of one prompt), is_end, rank (generating rank), reward...
    per_token         per-response-token columns [B, T] float32, T = longest response, 0 on padding:
                      logprobs, ref_logprobs, values, advantages, returns...; rollout_logprobs
                      (the generating engine's log-probs of the tokens it sampled, NaN when
                      the engine gave none) travels from generation to the store with the rest

It owns the padding (one place), the mapping between sequence positions and response tokens
(data/positions.py), micro-batches (by sample count or token budget, padded or packed:
models/packing.py), and moving samples over the DP ranks (through a balance.Route).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slurm_align.balance.rebalance import Route
from slurm_align.data.positions import gather_response, position_mask, response_positions, scatter_positions
from slurm_align.models.packing import Batching, micro_batch_inputs
from slurm_align.store.rollouts import TURN_DEFAULTS


def rollout_logprobs(out: Any, T: int) -> torch.Tensor:
    """The engine's per-token log-probs of a GenerationOutput as a [B, T] column (0 past each
    response; NaN throughout when the engine returned none, so nothing mistakes them for real)."""
    n = len(out.response_lengths)
    if out.logprobs is None:
        return torch.full((n, T), float("nan"))
    lp = torch.zeros(n, T)
    w = min(T, out.logprobs.shape[1])
    lp[:, :w] = out.logprobs[:, :w].float()
    return lp * response_positions(torch.ones(n, dtype=torch.int64), out.response_lengths, T)[1]


def collective_device(group: Any) -> torch.device:
    """Where a collective over `group` runs: NCCL takes CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def all_reduce_sums(values: Mapping[str, float | torch.Tensor], group: Any) -> dict[str, float]:
    """Sum named scalars over the ranks of `group` (one float64 all-reduce; None: this rank only)."""
    keys = list(values)
    vec = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        vec = vec.to(collective_device(group))
        dist.all_reduce(vec, group=group)
    return dict(zip(keys, vec.tolist()))


# -- the batch ---------------------------------------------------------------------------------
@dataclass
class RolloutBatch:
    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    pad_id: int
    samples: dict[str, torch.Tensor] = field(default_factory=dict)
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_sequences(cls, prompts: Sequence[Any], responses: Sequence[Any], pad_id: int,
                       **samples: Any) -> RolloutBatch:
        """Right-pad ragged 1-D prompts and responses (arrays or tensors); `samples` are
        per-sample columns (one value per sample)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        responses = [np.asarray(r, np.int64).reshape(-1) for r in responses]
        seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses)]
        plen = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
        rlen = torch.tensor([len(r) for r in responses], dtype=torch.int64)
        tokens = torch.full((len(seqs), max((len(s) for s in seqs), default=0)), pad_id, dtype=torch.int64)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.from_numpy(s)
        batch = cls(tokens, plen, rlen, pad_id)
        for name, values in samples.items():
            batch.samples[name] = torch.as_tensor(np.asarray(values))
        batch._check()
        return batch

    @classmethod
    def empty(cls, pad_id: int) -> RolloutBatch:
        """No samples (a rank that generated none)."""
        z = torch.zeros(0, dtype=torch.int64)
        return cls(torch.zeros(0, 0, dtype=torch.int64), z, z.clone(), pad_id)

    def _check(self) -> None:
        B = self.size
        for name, col in self.samples.items():
            if col.shape[:1] != (B,):
                raise ValueError(f"sample column {name!r} has shape {tuple(col.shape)}, expected ({B},)")
        for name, col in self.per_token.items():
            if tuple(col.shape) != (B, self.max_response):
                raise ValueError(f"token column {name!r} has shape {tuple(col.shape)}, expected "
                                 f"({B}, {self.max_response}) (samples x longest response)")

    # shape ----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.size

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    @property
    def max_response(self) -> int:
        """T: the width of the per-token columns."""
        return int(self.response_lengths.max()) if self.size else 0

    @property
    def mask(self) -> torch.Tensor:
        """[B, T] float: 1 on the response tokens that are trained: real tokens, times the
        `loss_mask` column where a multi-turn batch has one (the environment's tokens are 0: in
        the context, out of the policy loss, the KL, the value loss and the length statistics)."""
        mask = response_positions(self.prompt_lengths, self.response_lengths, self.max_response)[1]
        return mask * self.per_token["loss_mask"] if "loss_mask" in self.per_token else mask

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.samples:
            return self.samples[name]
        if name in self.per_token:
            return self.per_token[name]
        raise KeyError(f"RolloutBatch has no column {name!r} (sample columns {sorted(self.samples)}, "
                       f"token columns {sorted(self.per_token)})")

    def set_tokens(self, name: str, values: torch.Tensor) -> None:
        """Add or replace a per-token column [B, T]."""
        self.per_token[name] = values.float()
        self._check()

    def set_samples(self, name: str, values: Any) -> None:
        """Add or replace a per-sample column [B]."""
        self.samples[name] = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
        self._check()

    # the mapping ----------------------------------------------------------------------------
    def from_positions(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, W] over sequence positions -> [B, T] over response tokens (see module doc)."""
        return gather_response(per_position.cpu(), self.prompt_lengths, self.response_lengths, self.max_response)

    def to_positions(self, name: str) -> torch.Tensor:
        """A per-token column laid out over sequence positions, [B, L] (the critic's layout)."""
        return scatter_positions(self.per_token[name], self.prompt_lengths, self.response_lengths,
                                 self.tokens.shape[1])

    def position_mask(self) -> torch.Tensor:
        """[B, L]: 1 at the positions that predict a trained response token (self.mask)."""
        if "loss_mask" in self.per_token:
            return scatter_positions(self.mask, self.prompt_lengths, self.response_lengths, self.tokens.shape[1])
        return position_mask(self.prompt_lengths, self.response_lengths, self.tokens.shape[1])

    # selection ------------------------------------------------------------------------------
    def select(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> RolloutBatch:
        """The given rows, in that order, padded only as wide as they need."""
        rows = torch.as_tensor(np.asarray(rows, dtype=np.int64).reshape(-1))
        plen, rlen = self.prompt_lengths[rows], self.response_lengths[rows]
        L = int((plen + rlen).max()) if len(rows) else 0
        T = int(rlen.max()) if len(rows) else 0
        return RolloutBatch(self.tokens[rows, :L], plen, rlen, self.pad_id,
                            {k: v[rows] for k, v in self.samples.items()},
                            {k: v[rows, :T] for k, v in self.per_token.items()})

    def sorted_by(self, name: str) -> RolloutBatch:
        return self.select(torch.argsort(self.samples[name], stable=True))

    @classmethod
    def cat(cls, batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
        """Rows of every batch in order, re-padded to common widths (empty batches are skipped)."""
        full = [b for b in batches if b.size]
        if not full:
            return cls.empty(pad_id)
        keys = (sorted(full[0].samples), sorted(full[0].per_token))
        for b in full:
            if (sorted(b.samples), sorted(b.per_token)) != keys:
                raise ValueError(f"RolloutBatch.cat: columns differ ({keys} vs "
                                 f"{(sorted(b.samples), sorted(b.per_token))})")
        L = max(b.tokens.shape[1] for b in full)
        T = max(b.max_response for b in full)
        pad = lambda x, w, v: torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)  # noqa: E731
        return cls(torch.cat([pad(b.tokens, L, pad_id) for b in full]),
                   torch.cat([b.prompt_lengths for b in full]), torch.cat([b.response_lengths for b in full]),
                   pad_id, {k: torch.cat([b.samples[k] for b in full]) for k in keys[0]},
                   {k: torch.cat([pad(b.per_token[k], T, 0.0) for b in full]) for k in keys[1]})

    def merge(self, other: RolloutBatch, key: str = "index") -> None:
        """Take `other`'s columns, matching rows by `key` (same samples, any order)."""
        here = torch.argsort(self.samples[key])
        there = torch.argsort(other.samples[key])
        if not torch.equal(self.samples[key][here], other.samples[key][there]):
            raise ValueError(f"RolloutBatch.merge: the two batches hold different samples ({key} differs)")
        if not torch.equal(self.response_lengths[here], other.response_lengths[there]):
            raise ValueError("RolloutBatch.merge: response lengths differ for the same samples")
        inverse = torch.empty_like(here)
        inverse[here] = torch.arange(len(here))
        rows = there[inverse]  # row of `other` for each row of self
        for k, v in other.samples.items():
            if k != key:
                self.samples[k] = v[rows]
        for k, v in other.per_token.items():
            self.per_token[k] = v[rows]
        self._check()

    # the wire format: ragged numpy columns, nothing padded ------------------------------------
    def pack(self, samples: Sequence[str] | None = None, per_token: Sequence[str] | None = None,
             with_tokens: bool = True) -> dict[str, np.ndarray]:
        """Columns as flat numpy arrays (padding dropped) to send to another rank."""
        if not self.size:  # nothing to send; `unpack` skips empty parts
            return {"prompt_lengths": np.zeros(0, np.int64), "response_lengths": np.zeros(0, np.int64)}
        rlen, slen = self.response_lengths.numpy(), self.seq_lengths.numpy()
        out = {"prompt_lengths": self.prompt_lengths.numpy(), "response_lengths": rlen}
        if with_tokens:
            keep = np.arange(self.tokens.shape[1])[None, :] < slen[:, None]
            out["tokens"] = self.tokens.numpy()[keep]
        tmask = np.arange(self.max_response)[None, :] < rlen[:, None]
        for k in (self.samples if samples is None else samples):
            out[f"s:{k}"] = self.samples[k].numpy()
        for k in (self.per_token if per_token is None else per_token):
            out[f"t:{k}"] = self.per_token[k].numpy()[tmask]
        return out

    @classmethod
    def unpack(cls, parts: Sequence[dict[str, np.ndarray]], pad_id: int) -> RolloutBatch:
        """Inverse of pack over several parts (their rows in order). Without tokens the batch
        has tokens of width 0 (columns only, e.g. for `merge`)."""
        parts = [p for p in parts if len(p["response_lengths"])]
        if not parts:
            return cls.empty(pad_id)
        plen = torch.from_numpy(np.concatenate([p["prompt_lengths"] for p in parts]).astype(np.int64))
        rlen = torch.from_numpy(np.concatenate([p["response_lengths"] for p in parts]).astype(np.int64))
        B, T = len(rlen), int(rlen.max())
        if "tokens" in parts[0]:
            slen = (plen + rlen).numpy()
            tokens = np.full((B, int(slen.max())), pad_id, dtype=np.int64)
            tokens[np.arange(tokens.shape[1])[None, :] < slen[:, None]] = np.concatenate([p["tokens"] for p in parts])
        else:
            tokens = np.zeros((B, 0), dtype=np.int64)
        batch = cls(torch.from_numpy(tokens), plen, rlen, pad_id)
        tmask = np.arange(T)[None, :] < rlen.numpy()[:, None]
        for k in parts[0]:
            if k.startswith("s:"):
                batch.samples[k[2:]] = torch.from_numpy(np.concatenate([p[k] for p in parts]))
            elif k.startswith("t:"):
                col = np.zeros((B, T), dtype=np.float32)
                col[tmask] = np.concatenate([p[k] for p in parts])
                batch.per_token[k[2:]] = torch.from_numpy(col)
        batch._check()
        return batch

    def route(self, comm: Any, dp_rank: int, dp_size: int, *, expected: int | None = None) -> Route:
        """Collective: plan where every sample of the step goes (groups kept together, token
        counts balanced, equal sample counts per DP rank); see balance.rebalance.Route."""
        col = lambda k: self.samples[k].numpy() if self.size else np.zeros(0, np.int64)  # noqa: E731
        return Route.plan(comm, dp_rank, dp_size, index=col("index"), groups=col("group"),
                          lengths=self.seq_lengths.numpy(), expected=expected)

    def moved(self, route: Route, **pack_args: Any) -> RolloutBatch:
        """Collective: send each local sample where `route` says; returns this rank's share,
        sorted by index (so the result does not depend on who generated what)."""
        parts = [self.select(route.rows_for(d)).pack(**pack_args) for d in range(len(route.members))]
        return RolloutBatch.unpack(route.exchange(parts), self.pad_id).sorted_by("index")

    # training views -------------------------------------------------------------------------
    def micro_batches(self, batching: int | Batching, samples: Sequence[str] = (), per_token: Sequence[str] = (),
                      *, fixed_shape: bool = True) -> list[dict]:
        """Training micro-batches (models/packing.py: by sample count or token budget, padded or
        packed): tokens (padded rows [b, L], or packed rows with "packing", their layout),
        prompt_lengths, response_lengths, mask [b, T] and the named columns, per sequence.
        `fixed_shape` (pipeline buffers need one shape per step): padded micro-batches are
        filled up with copies of their last row whose mask is 0, packed ones share one shape."""
        if isinstance(batching, int):
            batching = Batching(micro_batch_size=batching)
        out, mask = [], self.mask
        groups = batching.groups(self.seq_lengths)
        for inp in micro_batch_inputs(self.tokens, self.seq_lengths, groups, pack=batching.pack,
                                      fixed_shape=fixed_shape):
            rows, real = inp["rows"], inp["real"]
            mb = {"tokens": inp["tokens"], "prompt_lengths": self.prompt_lengths[rows],
                  "response_lengths": self.response_lengths[rows], "mask": mask[rows] * real[:, None]}
            if "packing" in inp:
                mb["packing"] = inp["packing"]
            mb.update({k: self.samples[k][rows] for k in samples})
            mb.update({k: self.per_token[k][rows] for k in per_token})
            out.append(mb)
        return out

    def loss_microbatches(self, indices: Sequence[int], batching: int | Batching, columns: Sequence[str], *,
                          fixed_shape: bool) -> list[dict]:
        """The model worker's view (models/worker.py): the micro-batches of rows `indices` (one
        optimizer batch), with those of the loss's `columns` this batch has."""
        part = self.select(indices)
        return part.micro_batches(batching, samples=[c for c in columns if c in part.samples],
                                  per_token=[c for c in columns if c in part.per_token], fixed_shape=fixed_shape)

    def store_columns(self, names: Sequence[str], sample_names: Sequence[str]) -> dict[str, Any]:
        """Ragged per-sample arrays in the layout RolloutStore.append_step takes."""
        plen, rlen = self.prompt_lengths.tolist(), self.response_lengths.tolist()
        tok = self.tokens.numpy()
        cols: dict[str, Any] = {"prompt_tokens": [tok[i, :p] for i, p in enumerate(plen)],
                                "response_tokens": [tok[i, p:p + r] for i, (p, r) in enumerate(zip(plen, rlen))]}
        for k in names:
            if k not in self.per_token and k in TURN_DEFAULTS:
                continue   # single-turn: the store fills in its defaults
            col = self.per_token[k].numpy()
            cols[k] = [col[i, :r] for i, r in enumerate(rlen)]
        for k in sample_names:
            cols[k] = self.samples[k].numpy()
        return cols
