"""GPU profiling hooks on the traced phases, and a torch profiler window.

- `DeviceHooks`: around every span of a Tracer (profiling/timers.py), an NVTX range named after
  the phase (Nsight Systems shows the phases on the GPU timeline) and the device memory peak of
  the phase (torch.cuda.max_memory_allocated after a reset at the phase's start), which the step's
  metrics carry as `memory/<phase>` (bytes, max over the step's spans of that phase). Only made
  when CUDA is available (`device_hooks()` returns None otherwise: the CPU path pays nothing).
- `ProfilerWindow`: torch.profiler over steps a..b (run config `profiling.steps: [a, b]`), CPU and,
  where there is one, CUDA activity; a Chrome trace per rank in RUN_DIR/profile/<component>_rank<N>.json
  (open it in Perfetto or chrome://tracing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class DeviceHooks:
    def __init__(self, nvtx: bool = True):
        self.nvtx = nvtx
        self._peaks: dict[tuple[int, str], int] = {}

    def enter(self, phase: str, step: int) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_push(f"{phase} (step {step})")
        torch.cuda.reset_peak_memory_stats()

    def exit(self, phase: str, step: int) -> None:
        peak = int(torch.cuda.max_memory_allocated())
        key = (step, phase)
        self._peaks[key] = max(self._peaks.get(key, 0), peak)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()

    def memory(self, step: int) -> dict[str, int]:
        """Peak device bytes per phase of `step`; forgets them (call once per step)."""
        out = {phase: v for (s, phase), v in self._peaks.items() if s == step}
        self._peaks = {k: v for k, v in self._peaks.items() if k[0] > step}
        return out


def device_hooks(nvtx: bool = True) -> DeviceHooks | None:
    """Hooks for a Tracer where CUDA is available, else None."""
    return DeviceHooks(nvtx) if torch.cuda.is_available() else None


class ProfilerWindow:
    """torch.profiler from the start of step `first` to the end of step `last` (both included)."""

    def __init__(self, steps: tuple[int, int] | list[int] | None, out: Path):
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
        self.out = Path(out)
        self._prof: Any = None

    def step_begins(self, step: int) -> None:
        if self._prof is None and self.first <= step <= self.last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, profile_memory=True)
            self._prof.__enter__()

    def step_ends(self, step: int) -> None:
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out))
