"""Rollout store: RUN_DIR/rollouts.zarr, written by one rank, one row per PPO step.

Each committed step is one row of two arrays (rows are padded; the index says how much of each
row is valid), so appending a step is two row writes (usually one chunk file each, written
concurrently) and then the commit, one row of the index:

    tokens   int32   (steps, width)   prompt tokens (all samples, concatenated) | response tokens |
                                      per-sample prompt_length | length | rank | is_end | version
    values   float32 (steps, width)   per response token: logprobs | ref_logprobs | values |
                                      advantages | returns | rollout_logprobs | loss_mask |
                                      turn | role (TOKEN_FIELDS),
                                      then reward per sample (ref_logprobs is NaN in a run
                                      without a KL term: RunConfig.uses_reference)
    index    int64   (steps, 5)       step, samples, prompt tokens, response tokens of each row,
                                      committed (1; rows past the committed steps hold 0)

Few files per step: each is written atomically with an fsync (atomic.py), and the fsyncs, not the
bytes, are what an append costs (bench_store.py), so the columns are packed into two typed rows
rather than fourteen arrays. The index row is the commit: a step's data rows are written first
and its index row last (the index chunk is replaced atomically), so a reader never sees a
half-written step, and the next append (after a writer was killed) overwrites the remains in the
same row. Capacity grows by doubling (ragged.ensure_shape), so most appends rewrite no metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from slurm_align.store.atomic import AtomicLocalStore
from slurm_align.store.ragged import create, ensure_shape, next_pow2, pack, put_chunk, write_row

TURN_DEFAULTS = {"loss_mask": 1.0, "turn": 0.0, "role": 0.0}
"""Per-token fields of multi-turn trajectories, with their single-turn values (an append that
leaves them out stores these): loss_mask 1 on the model's tokens, 0 on the environment's;
turn: the turn's number (turn boundaries are where it changes); role: the turn's kind
(algorithms/conversations.py ROLE_CODES: 0 model, 1 tool, 2 user, 3 system)."""
TOKEN_FIELDS = ("logprobs", "ref_logprobs", "values", "advantages", "returns", "rollout_logprobs", *TURN_DEFAULTS)
"""Per response token, float32. logprobs: the trainer's (pi_old, at the start of the step);
rollout_logprobs: the generating engine's (NaN where the engine gave none), so the
engine/trainer mismatch of a run can be analysed afterwards; then TURN_DEFAULTS' fields."""
SAMPLE_FIELDS = {"reward": np.float32, "is_end": np.bool_, "rank": np.int32, "version": np.int32}
"""Per sample, given by the caller (length and step are filled in by the store). version: the
weight version (optimizer steps taken) of the policy that generated the sample."""
SAMPLE_INTS = ("prompt_length", "length", "rank", "is_end", "version")
"""Per-sample integers at the end of a `tokens` row, in this order."""
INDEX = ("step", "num_samples", "num_prompt_tokens", "num_response_tokens", "committed")
"""Columns of the `index` array."""
FORMAT = "slurm-align-rollouts/5"   # 3: rollout_logprobs added; 4: version; 5: loss_mask, turn, role
_INDEX_CHUNK = 256
_ROWS = 8   # initial step capacity (doubles as needed)


class RolloutStoreError(ValueError):
    """A batch that does not fit the schema, or an append that would leave a gap or duplicate."""


class RolloutStore:
    """One run's rollouts. Create once, then `append_step` per PPO step from a single rank.

    With `background=True` an append checks and packs the batch, then returns: the files are
    written by a writer thread while the caller goes on (the step does not wait on the disk's
    fsyncs). The next append, a read, `flush()` and `close()` wait for it (and raise its error,
    if it had one); a caller that checkpoints must flush first, so no checkpoint is ever ahead of
    the committed rollouts."""

    def __init__(self, group: zarr.Group, path: Path, *, background: bool = False):
        self.group, self.path, self.background = group, path, background
        self._pending: Future | None = None
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="rollout-commit") if background else None
        fmt = group.attrs.get("format")
        if fmt != FORMAT:
            raise RolloutStoreError(f"{path}: not a rollout store of this version (format attribute "
                                    f"{fmt!r}, expected {FORMAT!r})")
        self._open_arrays: dict[str, zarr.Array] = {}
        self._writers = ThreadPoolExecutor(2, thread_name_prefix="rollout-store")
        index = group["index"][:]
        committed = index[:, -1] == 1
        n = len(index) if committed.all() else int(np.argmin(committed))   # the leading committed rows
        self._index = index[:n]

    @classmethod
    def create(cls, path: str | Path, *, background: bool = False) -> RolloutStore:
        """A new, empty store (an existing one at `path` is opened, not cleared: resume)."""
        path = Path(path)
        group = zarr.open_group(store=AtomicLocalStore(path, fsync=True), mode="a")
        if "format" not in group.attrs:
            create(group, "index", (_INDEX_CHUNK, len(INDEX)), (_INDEX_CHUNK, len(INDEX)), np.int64)
            group.update_attributes({"format": FORMAT, "token_fields": list(TOKEN_FIELDS),
                                     "sample_ints": list(SAMPLE_INTS), "index_columns": list(INDEX)})
        return cls(group, path, background=background)

    @classmethod
    def open(cls, path: str | Path, *, read_only: bool = False, background: bool = False) -> RolloutStore:
        path = Path(path)
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"{path}: no rollout store here")
        store = AtomicLocalStore(path, read_only=read_only, fsync=True)
        return cls(zarr.open_group(store=store, mode="r" if read_only else "r+"), path, background=background)

    def flush(self) -> None:
        """Wait until the last append is committed (raises its error, if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.flush()
        for pool in (self._committer, self._writers):
            if pool is not None:
                pool.shutdown()

    @property
    def num_steps(self) -> int:
        self.flush()
        return len(self._index)

    @property
    def num_samples(self) -> int:
        self.flush()
        return int(self._index[:, 1].sum())

    @property
    def steps(self) -> np.ndarray:
        """Committed step numbers, ascending."""
        self.flush()
        return self._index[:, 0].copy()

    def step_sizes(self) -> dict[str, np.ndarray]:
        """Per committed step: step, num_samples, num_prompt_tokens, num_response_tokens."""
        self.flush()
        return {name: self._index[:, j].copy() for j, name in enumerate(INDEX)}

    def append_step(self, step: int, batch: Mapping[str, Any]) -> None:
        """Write one step's samples; visible to readers only once all of it is written.

        batch: prompt_tokens, response_tokens (lists of token sequences), the per-token fields
        (lists of float sequences, each as long as its response, or one padded 2-D array whose
        rows are cut to the response lengths), reward, is_end, rank, version (one per sample). Steps must
        increase: redoing a step needs truncate_to(step) first."""
        self.flush()
        if len(self._index) and step <= self._index[-1, 0]:
            raise RolloutStoreError(
                f"{self.path}: step {step} is not after the last committed step {int(self._index[-1, 0])}; "
                f"call truncate_to({step}) first to redo it (resume)")
        cols = _validate(batch)
        row, n = len(self._index), len(cols["length"])
        tokens = np.concatenate([cols["prompt_tokens"], cols["response_tokens"],
                                 *(cols[name].astype(np.int32) for name in SAMPLE_INTS)])
        values = np.concatenate([*(cols[name] for name in TOKEN_FIELDS), cols["reward"]])
        entry = np.array([step, n, len(cols["prompt_tokens"]), len(cols["response_tokens"]), 1], dtype=np.int64)
        if self._committer is not None:
            self._pending = self._committer.submit(self._write_step, row, entry, tokens, values)
        else:
            self._write_step(row, entry, tokens, values)

    def _write_step(self, row: int, entry: np.ndarray, tokens: np.ndarray, values: np.ndarray) -> None:
        arrays = self._arrays(len(tokens), len(values))
        for name, data in (("tokens", tokens), ("values", values)):
            ensure_shape(arrays[name], (row + 1, len(data)))
        # The two rows at once: on a busy disk their fsyncs share a journal commit (half the wait).
        list(self._writers.map(lambda job: write_row(arrays[job[0]], row, job[1]),
                               (("tokens", tokens), ("values", values))))
        self._index = np.concatenate([self._index, entry[None]])
        self._write_index(row)   # the commit, last

    def _write_index(self, row: int) -> None:
        """Write the index chunk holding `row` whole, from memory (no read-modify-write)."""
        index = self.group["index"] if not self._open_arrays else self._open_arrays["index"]
        lo = row - row % _INDEX_CHUNK
        ensure_shape(index, (lo + _INDEX_CHUNK, len(INDEX)))
        block = np.zeros((_INDEX_CHUNK, len(INDEX)), dtype=np.int64)
        rows = self._index[lo:lo + _INDEX_CHUNK]
        block[:len(rows)] = rows
        put_chunk(index, (lo // _INDEX_CHUNK, 0), block)

    def _arrays(self, tokens: int, values: int) -> dict[str, zarr.Array]:
        """The row arrays (kept open), created at the first append with chunks one row wide and
        sized to it."""
        if not self._open_arrays:
            g = self.group
            self._open_arrays = {name: create(g, name, (_ROWS, next_pow2(width, 256)),
                                              (1, next_pow2(width, 256)), dtype)
                                 for name, width, dtype in (("tokens", tokens, np.int32),
                                                            ("values", values, np.float32))}
            self._open_arrays["index"] = g["index"]
        return self._open_arrays

    def read(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Committed samples of one step (or all): flat arrays, offsets starting at 0."""
        self.flush()
        rows = np.arange(len(self._index))
        if step is not None:
            rows = np.flatnonzero(self._index[:, 0] == step)
            if not len(rows):
                raise KeyError(f"{self.path}: step {step} is not committed "
                               f"(committed: {self.steps.tolist()})")
        return self._read_rows(rows)

    def _read_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        idx = self._index[rows]
        if not len(rows) or not idx[:, 1].sum():
            return _empty()
        n, p, r = (idx[:, j] for j in (1, 2, 3))
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        token_rows = self.group["tokens"][lo:hi, : int((p + r + len(SAMPLE_INTS) * n).max())]
        value_rows = self.group["values"][lo:hi, : int((len(TOKEN_FIELDS) * r + n).max())]
        parts: dict[str, list[np.ndarray]] = {}
        for i, (ni, pi, ri) in zip(rows - lo, zip(n, p, r)):
            t, v = token_rows[i], value_rows[i]
            parts.setdefault("prompt_tokens", []).append(t[:pi])
            parts.setdefault("response_tokens", []).append(t[pi:pi + ri])
            for j, name in enumerate(SAMPLE_INTS):
                parts.setdefault(name, []).append(t[pi + ri + j * ni: pi + ri + (j + 1) * ni])
            for j, name in enumerate(TOKEN_FIELDS):
                parts.setdefault(name, []).append(v[j * ri:(j + 1) * ri])
            parts.setdefault("reward", []).append(v[len(TOKEN_FIELDS) * ri: len(TOKEN_FIELDS) * ri + ni])
        out = {name: np.concatenate(chunks) for name, chunks in parts.items()}
        for kind, lengths in (("prompt", out.pop("prompt_length")), ("response", out["length"])):
            out[f"{kind}_offsets"] = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        out["is_end"] = out["is_end"].astype(np.bool_)
        out["step"] = np.repeat(idx[:, 0], n)
        return out

    def truncate_to(self, step: int) -> None:
        """Forget every committed step >= `step`, so a run resumed at `step` appends without gaps
        or duplicates (their rows are overwritten by the next appends)."""
        self.flush()
        keep = int(np.searchsorted(self._index[:, 0], step, side="left"))
        first = len(self._index)
        if keep == first:
            return
        self._index = self._index[:keep]
        for lo in range(keep - keep % _INDEX_CHUNK, first, _INDEX_CHUNK):
            self._write_index(lo)


def _empty() -> dict[str, np.ndarray]:
    out = {"prompt_tokens": np.zeros(0, np.int32), "response_tokens": np.zeros(0, np.int32),
           "prompt_offsets": np.zeros(1, np.int64), "response_offsets": np.zeros(1, np.int64),
           "length": np.zeros(0, np.int32), "step": np.zeros(0, np.int64)}
    out.update({name: np.zeros(0, np.float32) for name in TOKEN_FIELDS})
    out.update({name: np.zeros(0, dt) for name, dt in SAMPLE_FIELDS.items()})
    return out


def _per_token(name: str, values: Any, lengths: np.ndarray) -> np.ndarray:
    """A per-token field as one flat float32 array: from ragged sequences or a padded 2-D array."""
    n = len(lengths)
    if isinstance(values, np.ndarray) or hasattr(values, "numpy"):
        arr = np.asarray(values, dtype=np.float32)
        if arr.ndim == 2 and arr.shape[0] == n and (n == 0 or arr.shape[1] >= lengths.max()):
            return arr[np.arange(arr.shape[1])[None, :] < lengths[:, None]]
    got = np.fromiter((len(s) for s in values), dtype=np.int64, count=len(values))
    if len(values) != n or not np.array_equal(got, lengths):
        bad = next((i for i in range(min(n, len(values))) if got[i] != lengths[i]), min(n, len(values)))
        raise RolloutStoreError(f"rollout batch key '{name}': sample {bad} does not have one value per "
                                f"response token (response lengths {lengths[:8].tolist()}...)")
    return pack(values, np.float32)[0]


def _validate(batch: Mapping[str, Any]) -> dict[str, Any]:
    required = ("prompt_tokens", "response_tokens", *TOKEN_FIELDS, *SAMPLE_FIELDS)
    missing = [k for k in required if k not in batch and k not in TURN_DEFAULTS]
    if missing:
        raise RolloutStoreError(f"rollout batch lacks key(s) {', '.join(missing)} (required: {', '.join(required)})")
    unknown = set(batch) - set(required) - {"length"}
    if unknown:
        raise RolloutStoreError(f"rollout batch has unknown key(s) {', '.join(sorted(unknown))}")
    n = len(batch["prompt_tokens"])
    for name in ("response_tokens", *SAMPLE_FIELDS):
        if len(batch[name]) != n:
            raise RolloutStoreError(f"rollout batch key '{name}' has {len(batch[name])} entries, "
                                    f"prompt_tokens has {n}: one per sample is required")
    cols: dict[str, Any] = {}
    cols["prompt_tokens"], p_off = pack(batch["prompt_tokens"], np.int32)
    cols["response_tokens"], r_off = pack(batch["response_tokens"], np.int32)
    lengths = np.diff(r_off)
    for name in TOKEN_FIELDS:
        if name in batch:
            cols[name] = _per_token(name, batch[name], lengths)
        else:
            cols[name] = np.full(int(lengths.sum()), TURN_DEFAULTS[name], np.float32)
    for name, dt in SAMPLE_FIELDS.items():
        cols[name] = np.asarray(batch[name], dtype=dt).reshape(n)
    if "length" in batch and not np.array_equal(np.asarray(batch["length"]), lengths):
        raise RolloutStoreError("rollout batch key 'length' disagrees with the response lengths")
    cols["length"] = lengths
    cols["prompt_length"] = np.diff(p_off)
    return cols
