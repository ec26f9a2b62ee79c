"""Tracer: named spans per rank, buffered in memory and committed to RUN_DIR/traces.zarr per step.

    tracer = Tracer(run_dir, "actor", rank)
    with tracer.span(phases.GENERATE, step):
        ...
    tracer.step_done(step)   # commit this step's spans (also done when a later step's span opens)
    tracer.close()

Times are wall clock in ns: time.time_ns() taken once at start, plus perf_counter_ns() offsets,
so spans are monotonic within a process and comparable across processes and hosts (up to the
hosts' clock agreement). A disabled tracer hands out one shared no-op context: near-zero cost.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_align.profiling.watchdog import Watchdog

if TYPE_CHECKING:   # device.py imports torch; the tracer itself does not need it
    from slurm_align.profiling.device import DeviceHooks
from slurm_align.store.traces import TraceWriter

_NULL = contextlib.nullcontext()


class _Span:
    __slots__ = ("phase", "start", "step", "tracer")

    def __init__(self, tracer: Tracer, phase: str, step: int):
        self.tracer, self.phase, self.step = tracer, phase, step

    def __enter__(self):
        if self.tracer.watchdog is not None:
            self.tracer.watchdog.enter(self.phase, self.step)
        if self.tracer.device is not None:
            self.tracer.device.enter(self.phase, self.step)
        self.start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self.tracer._add(self.step, self.phase, self.start, time.perf_counter_ns())
        if self.tracer.device is not None:
            self.tracer.device.exit(self.phase, self.step)
        if self.tracer.watchdog is not None:   # a closed span is progress (profiling/watchdog.py)
            self.tracer.watchdog.progress(self.phase, self.step)
        return False


class Tracer:
    """Spans of one rank of one component. Only this rank writes its group (`<component>/rank<N>`)."""

    def __init__(self, run_dir: str | Path | None, component: str, rank: int, *, enabled: bool = True,
                 resume_from_step: int | None = None):
        self.component, self.rank = component, int(rank)
        self.enabled = enabled and run_dir is not None
        self._origin = time.time_ns() - time.perf_counter_ns()
        self._steps: list[int] = []
        self._phases: list[str] = []
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._writer = None
        self.watchdog: Watchdog | None = None
        """Told of every span opened and closed, when the run sets fault_tolerance.hang_timeout_s."""
        self.device: DeviceHooks | None = None
        """NVTX ranges and device memory per phase (profiling/device.py), where CUDA is available."""
        if self.enabled and run_dir is not None:   # enabled: there is a run_dir
            self._writer = TraceWriter(Path(run_dir) / "traces.zarr", component, self.rank)
            if resume_from_step is not None:
                # Spans of steps redone after a resume must not be counted twice.
                self._writer.truncate_to(resume_from_step)

    def span(self, phase: str, step: int):
        """Context manager timing one span of `phase` in `step`."""
        if not self.enabled:
            return _NULL
        if self._steps and step > self._steps[-1]:
            self.flush()  # a later step has begun: the earlier ones are whole
        return _Span(self, phase, int(step))

    def record(self, phase: str, step: int, start_ns: int, end_ns: int) -> None:
        """Add a span timed elsewhere (wall-clock ns, time.time_ns() base)."""
        if self.enabled:
            self._steps.append(int(step))
            self._phases.append(phase)
            self._starts.append(int(start_ns))
            self._ends.append(int(end_ns))

    def _add(self, step: int, phase: str, start_pc: int, end_pc: int) -> None:
        self.record(phase, step, self._origin + start_pc, self._origin + end_pc)

    def durations(self, step: int) -> dict[str, float]:
        """Seconds per phase of `step` on this rank, from the spans not yet flushed (call before
        step_done): the `timers/` metrics."""
        out: dict[str, float] = {}
        for st, ph, a, b in zip(self._steps, self._phases, self._starts, self._ends):
            if st == step:
                out[ph] = out.get(ph, 0.0) + (b - a) / 1e9
        return out

    def now_ns(self) -> int:
        """The tracer's clock, for spans passed to record()."""
        return self._origin + time.perf_counter_ns()

    def step_done(self, step: int) -> None:
        """Commit everything buffered so far (call at the end of each step)."""
        self.flush()

    def flush(self) -> None:
        if self._writer is None or not self._steps:
            return
        self._writer.append(self._steps, self._phases, self._starts, self._ends)
        self._steps, self._phases, self._starts, self._ends = [], [], [], []

    def close(self) -> None:
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
