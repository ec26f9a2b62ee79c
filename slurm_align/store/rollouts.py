"""Rollout store: RUN_DIR/rollouts.zarr, written by one rank after the gather, one append per step.

Arrays (flat values + int64 offsets of length n+1 for ragged data, see ragged.py):
    prompt_tokens, prompt_offsets            int32 tokens of each sample's prompt
    response_tokens, response_offsets        int32 tokens of each sample's response
    logprobs, ref_logprobs, values,          float32, one per response token (share response_offsets)
      advantages, returns
    reward (float32), length (int32, response tokens), is_end (bool), step (int64),
      rank (int32, generating rank)          one per sample
    steps, step_offsets                      committed step numbers and their sample ranges (n+1)
Root attributes `num_steps`, `num_samples`, `num_prompt_tokens`, `num_response_tokens` are the
commit: a step's arrays are written first and these counts last, so a reader never sees a
half-written step, and the next append (after a writer was killed) overwrites its remains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zarr

from slurm_align.store.atomic import AtomicLocalStore
from slurm_align.store.ragged import growable, pack, write_at

TOKEN_FIELDS = ("logprobs", "ref_logprobs", "values", "advantages", "returns")
"""Per response token, float32."""
SAMPLE_FIELDS = {"reward": np.float32, "is_end": np.bool_, "rank": np.int32}
"""Per sample, given by the caller (length and step are filled in by the store)."""
_COUNTS = ("num_steps", "num_samples", "num_prompt_tokens", "num_response_tokens")
_DTYPES = {
    "prompt_tokens": np.int32, "prompt_offsets": np.int64, "response_tokens": np.int32,
    "response_offsets": np.int64, **{f: np.float32 for f in TOKEN_FIELDS}, **SAMPLE_FIELDS,
    "length": np.int32, "step": np.int64, "steps": np.int64, "step_offsets": np.int64,
}
FORMAT = "slurm-align-rollouts/1"


class RolloutStoreError(ValueError):
    """A batch that does not fit the schema, or an append that would leave a gap or duplicate."""


class RolloutStore:
    """One run's rollouts. Create once, then `append_step` per PPO step from a single rank."""

    def __init__(self, group: zarr.Group, path: Path):
        self.group, self.path = group, path
        if group.attrs.get("format") != FORMAT:
            raise RolloutStoreError(f"{path}: not a rollout store (format attribute "
                                    f"{group.attrs.get('format')!r}, expected {FORMAT!r})")

    @classmethod
    def create(cls, path: str | Path) -> "RolloutStore":
        """A new, empty store (an existing one at `path` is opened, not cleared: resume)."""
        path = Path(path)
        group = zarr.open_group(store=AtomicLocalStore(path, fsync=True), mode="a")
        if "format" not in group.attrs:
            for name, dt in _DTYPES.items():
                growable(group, name, dt)
            for name in ("prompt_offsets", "response_offsets", "step_offsets"):
                write_at(group[name], 0, np.zeros(1, dtype=np.int64))
            group.attrs.update({"format": FORMAT, **{k: 0 for k in _COUNTS}})
        return cls(group, path)

    @classmethod
    def open(cls, path: str | Path, *, read_only: bool = False) -> "RolloutStore":
        path = Path(path)
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"{path}: no rollout store here")
        store = AtomicLocalStore(path, read_only=read_only, fsync=True)
        return cls(zarr.open_group(store=store, mode="r" if read_only else "r+"), path)

    def _counts(self) -> dict[str, int]:
        attrs = self.group.attrs.asdict()
        return {k: int(attrs[k]) for k in _COUNTS}

    @property
    def num_steps(self) -> int:
        return self._counts()["num_steps"]

    @property
    def num_samples(self) -> int:
        return self._counts()["num_samples"]

    @property
    def steps(self) -> np.ndarray:
        """Committed step numbers, ascending."""
        return self.group["steps"][: self.num_steps]

    def append_step(self, step: int, batch: Mapping[str, Any]) -> None:
        """Write one step's samples; visible to readers only once all of it is written.

        batch: prompt_tokens, response_tokens (lists of token sequences), the per-token fields
        (lists of float sequences, each as long as its response), reward, is_end, rank (one per
        sample). Steps must increase: redoing a step needs truncate_to(step) first."""
        c = self._counts()
        steps = self.group["steps"][: c["num_steps"]]
        if len(steps) and step <= steps[-1]:
            raise RolloutStoreError(
                f"{self.path}: step {step} is not after the last committed step {int(steps[-1])}; "
                f"call truncate_to({step}) first to redo it (resume)")
        cols = _validate(batch)
        n = len(cols["length"])
        g = self.group
        prompts, p_off = cols.pop("prompt_tokens")
        responses, r_off = cols.pop("response_tokens")
        write_at(g["prompt_tokens"], c["num_prompt_tokens"], prompts)
        write_at(g["prompt_offsets"], c["num_samples"] + 1, p_off[1:] + c["num_prompt_tokens"])
        write_at(g["response_tokens"], c["num_response_tokens"], responses)
        write_at(g["response_offsets"], c["num_samples"] + 1, r_off[1:] + c["num_response_tokens"])
        for name in TOKEN_FIELDS:
            write_at(g[name], c["num_response_tokens"], cols[name])
        for name in (*SAMPLE_FIELDS, "length"):
            write_at(g[name], c["num_samples"], cols[name])
        write_at(g["step"], c["num_samples"], np.full(n, step, dtype=np.int64))
        write_at(g["steps"], c["num_steps"], np.array([step], dtype=np.int64))
        write_at(g["step_offsets"], c["num_steps"] + 1, np.array([c["num_samples"] + n], dtype=np.int64))
        # The commit: counts last.
        g.attrs.update({"num_steps": c["num_steps"] + 1, "num_samples": c["num_samples"] + n,
                        "num_prompt_tokens": c["num_prompt_tokens"] + len(prompts),
                        "num_response_tokens": c["num_response_tokens"] + len(responses)})

    def read(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Committed samples of one step (or all): flat arrays, offsets rebased to start at 0."""
        c = self._counts()
        g = self.group
        lo, hi = 0, c["num_samples"]
        if step is not None:
            steps = g["steps"][: c["num_steps"]]
            where = np.flatnonzero(steps == step)
            if not len(where):
                raise KeyError(f"{self.path}: step {step} is not committed "
                               f"(committed: {steps.tolist()})")
            bounds = g["step_offsets"][int(where[0]): int(where[0]) + 2]
            lo, hi = int(bounds[0]), int(bounds[1])
        out: dict[str, np.ndarray] = {}
        for kind in ("prompt", "response"):
            off = g[f"{kind}_offsets"][lo: hi + 1]
            a, b = (int(off[0]), int(off[-1])) if len(off) else (0, 0)
            out[f"{kind}_offsets"] = off - a
            out[f"{kind}_tokens"] = g[f"{kind}_tokens"][a:b]
            if kind == "response":
                for name in TOKEN_FIELDS:
                    out[name] = g[name][a:b]
        for name in (*SAMPLE_FIELDS, "length", "step"):
            out[name] = g[name][lo:hi]
        return out

    def truncate_to(self, step: int) -> None:
        """Forget every committed step >= `step`, so a run resumed at `step` appends without gaps
        or duplicates."""
        c = self._counts()
        g = self.group
        steps = g["steps"][: c["num_steps"]]
        keep = int(np.searchsorted(steps, step, side="left"))
        if keep == c["num_steps"]:
            return
        n = int(g["step_offsets"][keep])
        p = int(g["prompt_offsets"][n])
        r = int(g["response_offsets"][n])
        g.attrs.update({"num_steps": keep, "num_samples": n, "num_prompt_tokens": p,
                        "num_response_tokens": r})
        # Tidy the tails (readers never look past the counts anyway).
        ends = {"steps": keep, "step_offsets": keep + 1, "prompt_offsets": n + 1, "response_offsets": n + 1,
                "prompt_tokens": p, "response_tokens": r, **{f: r for f in TOKEN_FIELDS},
                **{f: n for f in (*SAMPLE_FIELDS, "length", "step")}}
        for name, end in ends.items():
            g[name].resize((end,))


def _validate(batch: Mapping[str, Any]) -> dict[str, Any]:
    required = ("prompt_tokens", "response_tokens", *TOKEN_FIELDS, *SAMPLE_FIELDS)
    missing = [k for k in required if k not in batch]
    if missing:
        raise RolloutStoreError(f"rollout batch lacks key(s) {', '.join(missing)} (required: {', '.join(required)})")
    unknown = set(batch) - set(required) - {"length"}
    if unknown:
        raise RolloutStoreError(f"rollout batch has unknown key(s) {', '.join(sorted(unknown))}")
    n = len(batch["prompt_tokens"])
    cols: dict[str, Any] = {}
    cols["prompt_tokens"] = pack(batch["prompt_tokens"], np.int32)
    flat, r_off = cols["response_tokens"] = pack(batch["response_tokens"], np.int32)
    lengths = np.diff(r_off).astype(np.int32)
    for name in ("response_tokens", *SAMPLE_FIELDS):
        if len(batch[name]) != n:
            raise RolloutStoreError(f"rollout batch key '{name}' has {len(batch[name])} entries, "
                                    f"prompt_tokens has {n}: one per sample is required")
    for name in TOKEN_FIELDS:
        seqs = batch[name]
        got = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        if len(seqs) != n or not np.array_equal(got, lengths):
            bad = next((i for i in range(min(n, len(seqs))) if got[i] != lengths[i]), min(n, len(seqs)))
            raise RolloutStoreError(f"rollout batch key '{name}': sample {bad} does not have one value per "
                                    f"response token (response lengths {lengths[:8].tolist()}...)")
        cols[name] = pack(seqs, np.float32)[0]
    for name, dt in SAMPLE_FIELDS.items():
        cols[name] = np.asarray(batch[name], dtype=dt).reshape(n)
    if "length" in batch and not np.array_equal(np.asarray(batch["length"]), lengths):
        raise RolloutStoreError("rollout batch key 'length' disagrees with the response lengths")
    cols["length"] = lengths
    return cols
