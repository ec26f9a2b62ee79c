"""Profiling hooks (profiling/device.py): the torch profiler window on CPU; NVTX ranges and
device memory per phase on a GPU (marker gpu)."""

from __future__ import annotations

import json

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.profiling.device import DeviceHooks, ProfilerWindow, device_hooks
from slurm_align.profiling.timers import Tracer


def test_the_profiler_window_traces_its_steps_only(tmp_path):
    out = tmp_path / "profile" / "actor_rank0.json"
    window = ProfilerWindow((2, 3), out)
    for step in range(1, 5):
        window.step_begins(step)
        with torch.profiler.record_function(f"work_of_step{step}"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        window.step_ends(step)
        assert out.exists() == (step >= 3)   # written when the window closes
    names = {e.get("name") for e in json.loads(out.read_text())["traceEvents"]}
    assert {"work_of_step2", "work_of_step3"} <= names and not names & {"work_of_step1", "work_of_step4"}


def test_a_run_that_ends_inside_the_window_still_writes_its_trace(tmp_path):
    window = ProfilerWindow((2, 10), tmp_path / "t.json")
    window.step_begins(2)
    window.step_ends(2)
    window.close()
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] is not None
    ProfilerWindow(None, tmp_path / "none.json").step_begins(1)   # no window: nothing starts
    assert not (tmp_path / "none.json").exists()


def test_the_window_is_checked_in_the_run_config():
    with pytest.raises(ConfigError, match=r"profiling.steps.*1 <= a <= b"):
        load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", ["profiling.steps=[3,2]"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path")
def test_no_device_hooks_without_cuda():
    assert device_hooks() is None


@pytest.mark.gpu
def test_nvtx_ranges_and_the_device_memory_peak_of_each_phase(tmp_path):
    tracer = Tracer(tmp_path, "actor", 0)
    tracer.device = device_hooks()
    assert isinstance(tracer.device, DeviceHooks)
    with tracer.span("generate", 1):
        small = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")        # 1 MiB
    with tracer.span("train", 1):
        big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")         # 64 MiB
    del small, big
    memory = tracer.device.memory(1)
    assert memory["train"] >= 64 << 20 and memory["generate"] < 64 << 20, memory
    assert tracer.device.memory(1) == {}   # read once per step
