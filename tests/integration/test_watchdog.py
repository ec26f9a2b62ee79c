"""The watchdog in a real job (local profile, two mpirun SFT ranks): SIGSTOP of one rank ends the
job, the live rank's log holds every thread's stack, and status names the stopped rank and its phase."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.status import run_status

pytestmark = pytest.mark.mpi
SYNTH = REPO_ROOT / "examples" / "synthetic"


def test_a_stopped_rank_fails_the_job_with_stacks_and_status_names_it(tmp_path: Path):
    run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={SYNTH / 'sft_train.jsonl'}", f"data.val_path={SYNTH / 'sft_val.jsonl'}",
        "trainer.num_steps=100000", "trainer.save_interval=0", "fault_tolerance.hang_timeout_s=15"])
    job = launch_run(run, load_profile("local"), tmp_path / "run")
    logs = tmp_path / "run" / "logs" / "actor"
    beat, deadline = logs / "heartbeat_rank1.json", time.monotonic() + 300   # a ceiling, not a speed bound
    while not (beat.is_file() and json.loads(beat.read_text())["step"] and json.loads(beat.read_text())["step"] > 2):
        assert time.monotonic() < deadline, "rank 1 never reached step 3"
        time.sleep(0.2)
    pid = json.loads(beat.read_text())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert job.wait(timeout_s=300) == "FAILED"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    failed = run_status(job).failed
    assert failed is not None and (failed.component, failed.rank) == ("actor", 1), failed
    assert "hung: no progress in phase step of step" in failed.why and "its process had stopped running" in failed.why
    rank0 = (logs / "rank0.log").read_text()
    assert "slurm-align watchdog: rank 0 made no progress" in rank0 and "most recent call first" in rank0
