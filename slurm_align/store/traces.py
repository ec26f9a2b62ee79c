"""Trace store: RUN_DIR/traces.zarr, one group per rank (`<component>/rank<N>`), one writer each.

Layout of a rank group:
    spans    int64 (capacity, 4): one row per span, columns step, phase, start_ns, end_ns
             (phase is a code into the group attribute `phases`, a list of names)
    attrs: component, rank, phases, committed (rows a reader may read), last_step, clock

A flush writes its rows past `committed` (whole chunks from memory, usually one, without reading
them back) and rewrites the attributes last (keys are replaced atomically, see atomic.py), so a
reader sees whole flushes only: a writer killed mid-flush leaves the previous commit intact, and its tail is overwritten
by the next writer. The array grows by doubling, so a flush rarely rewrites its metadata.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zarr
from zarr.errors import ContainsGroupError

from slurm_align.profiling.phases import SPAN_DTYPE
from slurm_align.store.atomic import AtomicLocalStore
from slurm_align.store.ragged import create, ensure_shape, put_chunk

COLUMNS = ("step", "phase", "start_ns", "end_ns")
"""Columns of a rank group's `spans` array."""
_CHUNK_ROWS = 2048
CLOCK = "time.time_ns() anchor at Tracer start + time.perf_counter_ns() offsets"


def rank_group_path(component: str, rank: int) -> str:
    return f"{component}/rank{int(rank)}"


def _require_group(root: zarr.Group, path: str) -> zarr.Group:
    # Several ranks create the shared parents at once: a lost race is fine, the group is there.
    node = root
    for part in path.split("/"):
        for _ in range(5):
            try:
                node = node.require_group(part)
                break
            except (ContainsGroupError, FileExistsError):
                time.sleep(0.01)
        else:
            node = node[part]
    return node


def _open_root(path: Path) -> zarr.Group:
    # Every rank of a new run opens (creates) the root at once; the losers find it there.
    for attempt in range(20):
        try:
            return zarr.open_group(store=AtomicLocalStore(path), mode="a")
        except (ContainsGroupError, FileExistsError):
            time.sleep(0.01 * (attempt + 1))
    return zarr.open_group(store=AtomicLocalStore(path), mode="a")


class TraceWriter:
    """Appends span batches to one rank's group. Only this rank writes there."""

    def __init__(self, path: Path, component: str, rank: int):
        self.root = _open_root(path)
        self.group = _require_group(self.root, rank_group_path(component, rank))
        self.spans = create(self.group, "spans", (_CHUNK_ROWS, len(COLUMNS)), (_CHUNK_ROWS, len(COLUMNS)),
                            np.int64)
        self._tail, self._tail_start = np.zeros((0, len(COLUMNS)), dtype=np.int64), -1
        attrs = self.group.attrs.asdict()
        self.committed = int(attrs.get("committed", 0))
        self.phases: list[str] = list(attrs.get("phases", []))
        self.last_step = attrs.get("last_step")
        self.meta = {"component": component, "rank": int(rank), "clock": CLOCK}
        if not attrs:
            self._commit(0, None)

    def _commit(self, committed: int, last_step) -> None:
        self.group.update_attributes({**self.meta, "phases": self.phases, "committed": committed,
                                 "last_step": last_step})
        self.committed, self.last_step = committed, last_step

    def _write(self, start: int, rows: np.ndarray) -> None:
        """Rows at [start, start+len): the chunks they touch are written whole, the rows of the
        first chunk before `start` taken from memory (they are committed, hence unchanged)."""
        lo = start - start % _CHUNK_ROWS
        if self._tail_start != lo:
            self._tail, self._tail_start = self.spans[lo:start], lo
        block = np.concatenate([self._tail[: start - lo], rows])
        end = lo + len(block)
        ensure_shape(self.spans, (end + (-end) % _CHUNK_ROWS, len(COLUMNS)))
        for a in range(0, len(block), _CHUNK_ROWS):
            chunk = np.zeros((_CHUNK_ROWS, len(COLUMNS)), dtype=np.int64)
            part = block[a:a + _CHUNK_ROWS]
            chunk[:len(part)] = part
            put_chunk(self.spans, ((lo + a) // _CHUNK_ROWS, 0), chunk)
        last = end - end % _CHUNK_ROWS if end % _CHUNK_ROWS else end
        self._tail, self._tail_start = block[last - lo:], last

    def append(self, steps, phases, starts, ends) -> None:
        if not len(steps):
            return
        codes = []
        for name in phases:
            if name not in self.phases:
                self.phases.append(name)
            codes.append(self.phases.index(name))
        rows = np.stack([np.asarray(c, dtype=np.int64) for c in (steps, codes, starts, ends)], axis=1)
        self._write(self.committed, rows)
        last = int(rows[:, 0].max()) if self.last_step is None else max(int(self.last_step), int(rows[:, 0].max()))
        self._commit(self.committed + len(rows), last)

    def truncate_to(self, step: int) -> None:
        """Drop committed spans of steps >= step (resume from a checkpoint taken before `step`)."""
        rows = self.spans[: self.committed]
        kept = rows[rows[:, 0] < step]
        if len(kept) == self.committed:
            return
        self._commit(0, None)  # readers see nothing while the kept spans are rewritten
        if len(kept):
            self._write(0, kept)
        self._commit(len(kept), int(kept[:, 0].max()) if len(kept) else None)


@dataclass
class TraceTable:
    """All committed spans of a run (numpy structured array, SPAN_DTYPE) and what is missing."""

    spans: np.ndarray
    ranks: dict[str, list[int]] = field(default_factory=dict)
    """Ranks found per component."""
    missing_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Ranks expected (from the run config) but without a group or without any span."""
    missing_steps: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    """component -> rank -> steps that other ranks of that component have and this one lacks."""

    @property
    def complete(self) -> bool:
        return not any(self.missing_ranks.values()) and not any(self.missing_steps.values())

    def problems(self) -> list[str]:
        out = []
        for comp, ranks in self.missing_ranks.items():
            if ranks:
                out.append(f"component '{comp}': no spans from rank(s) {_ranges(ranks)}")
        for comp, per_rank in self.missing_steps.items():
            for rank, steps in sorted(per_rank.items()):
                out.append(f"component '{comp}' rank {rank}: missing step(s) {_ranges(steps)}")
        return out


def _ranges(values) -> str:
    values = sorted(int(v) for v in values)
    parts, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)


def read_traces(path: Path, expected_ranks: dict[str, int] | None = None) -> TraceTable:
    """Load every committed span under `path` (a traces.zarr). `expected_ranks` (component ->
    world size, e.g. from the run config) lets missing ranks be named."""
    root = zarr.open_group(store=AtomicLocalStore(path, read_only=True), mode="r")
    parts, found = [], {}
    for comp, cgroup in sorted(root.groups()):
        for name, rgroup in cgroup.groups():
            if not name.startswith("rank") or not name[4:].isdigit():
                continue
            attrs = rgroup.attrs.asdict()
            n = int(attrs.get("committed", 0))
            rank = int(name[4:])
            if n == 0:
                continue
            found.setdefault(comp, []).append(rank)
            names = np.asarray(attrs["phases"], dtype="U32")
            rows = rgroup["spans"][:n]
            t = np.zeros(n, dtype=SPAN_DTYPE)
            t["step"], t["phase"] = rows[:, 0], names[rows[:, 1]]
            t["start_ns"], t["end_ns"] = rows[:, 2], rows[:, 3]
            t["rank"], t["component"] = rank, comp
            parts.append(t)
    spans = np.concatenate(parts) if parts else np.zeros(0, dtype=SPAN_DTYPE)
    spans = spans[np.argsort(spans["start_ns"], kind="stable")]
    table = TraceTable(spans=spans, ranks={c: sorted(r) for c, r in found.items()})
    for comp in sorted(set(found) | set(expected_ranks or {})):
        have = set(found.get(comp, []))
        want = set(range(expected_ranks[comp])) if expected_ranks and comp in expected_ranks else have
        table.missing_ranks[comp] = sorted(want - have)
        sel = spans[spans["component"] == comp]
        all_steps = set(np.unique(sel["step"]).tolist())
        gaps = {}
        for rank in sorted(have):
            mine = set(np.unique(sel["step"][sel["rank"] == rank]).tolist())
            if all_steps - mine:
                gaps[rank] = sorted(all_steps - mine)
        table.missing_steps[comp] = gaps
    return table


def drop_incomplete_steps(table: TraceTable) -> np.ndarray:
    """Spans of the steps that every found rank of every component recorded."""
    bad = {s for per_rank in table.missing_steps.values() for steps in per_rank.values() for s in steps}
    if not bad:
        return table.spans
    return table.spans[~np.isin(table.spans["step"], sorted(bad))]
