"""Preemption, time limits and a kill during a checkpoint write, on the real local Slurm cluster.

Every interrupted run must end as the uninterrupted reference run does (same seeds): each step
stored once, metrics continuous, final actor (weights and AdamW state) and critic weights equal
within 1e-5. Signals are triggered on observed events (a checkpoint saved, a step done),
never after a sleep.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from slurm_align.config import load_profile
from slurm_align.slurm.launch import Job, JobRecord, launch_run
from slurm_align.slurm.render import Entry
from tests.preempt_support import (
    DETERMINISTIC, assert_same_final_state, assert_unchanged, cli, events, logs_text, snapshot, wait_for,
)
from tests.test_ppo import tiny_run

FAULTY_ACTOR = Path(__file__).parent / "preempt_faulty_actor.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, on the local profile, started at once; waited for when first read."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    job = launch_run(tiny_run(*DETERMINISTIC), load_profile("local"), run_dir)

    def done() -> Path:
        state = job.wait(timeout_s=900)
        assert state == "COMPLETED", f"reference run {state}\n{logs_text(run_dir)}"
        return run_dir
    return done


def _status(run_dir: Path) -> dict:
    proc = cli("status", str(run_dir), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slurm
def test_time_limit_requeues_then_stops_then_resume_completes(slurm_cluster, reference, tmp_path):
    """Slurm's own warning (--signal=B:USR2@grace before the time limit): the run checkpoints and
    requeues as the same job; at max_requeues it ends STOPPED; `submit --resume` completes it."""
    run_dir = tmp_path / "run"
    profile = load_profile("local-slurm", ["time=2", "signal_grace_s=110", "requeue=true", "max_requeues=1"])
    job = launch_run(tiny_run(*DETERMINISTIC), profile, run_dir)
    first = wait_for(lambda: events(run_dir, "saved"), "the first stop's checkpoint", job=job)[0]["step"]
    before = snapshot(run_dir, first)   # the requeued job starts >= cred_expire (5 s) later
    assert job.wait(timeout_s=900, poll_s=0.5) == "STOPPED", logs_text(run_dir)

    saved = [e["step"] for e in events(run_dir, "saved")]
    assert [e["step"] for e in events(run_dir, "requeued")] == saved[:1]      # then the limit
    assert [e["signal"] for e in events(run_dir, "stop_requested")] == ["USR2", "USR2"]
    assert (run_dir / "requeue_count").read_text().strip() == "1"
    status = _status(run_dir)
    assert (status["state"], status["requeues"], status["stopped_at_step"], status["last_checkpoint_step"]) == \
        ("STOPPED", 1, saved[-1], saved[-1])
    out = "".join(p.read_text() for p in (run_dir / "logs").glob("job-*.out"))
    assert f"stopped for preemption at step {saved[0]}; requeueing" in out
    assert f"stopped for preemption at step {saved[-1]} (resume" in out

    proc = cli("submit", "--resume", str(run_dir), "-P", "time=10", "--follow", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs_text(run_dir)
    log = (run_dir / "logs" / "actor" / "rank0.log").read_text()
    for step in saved:   # each start names the checkpoint it goes on from
        assert f"resuming from step {step + 1} " in log
    assert_unchanged(before, snapshot(run_dir, first))   # the first steps were not redone
    assert_same_final_state(run_dir, reference(), tmp_path)


@pytest.mark.slurm
def test_kill_during_checkpoint_write_then_resume_and_usr2_requeue(slurm_cluster, reference, tmp_path):
    """Rank 0 of the actor is killed -9 while a checkpoint is written: the job FAILS within 30 s,
    `status` names the actor, the rank and its log tail, and the half-written checkpoint is never
    used. Resumed, the job gets USR2 after a step: it checkpoints, requeues and completes."""
    run_dir = tmp_path / "run"
    job = launch_run(tiny_run(*DETERMINISTIC), load_profile("local-slurm"), run_dir,
                     entry=Entry(scripts={"actor": FAULTY_ACTOR}))
    log = run_dir / "logs" / "actor" / "rank0.log"
    wait_for(lambda: log.exists() and "killing rank 0" in log.read_text(), "the kill", job=job)
    t0 = time.monotonic()
    assert job.wait(timeout_s=60, poll_s=0.2) == "FAILED"
    assert time.monotonic() - t0 < 30
    checkpoints = run_dir / "checkpoints" / "actor"
    committed = sorted(p.name for p in checkpoints.glob("iter_*") if (p / "manifest.json").is_file())
    partial = sorted(p.name for p in checkpoints.glob("iter_*.tmp"))
    assert len(committed) == 1 and len(partial) == 1, (committed, partial)
    kept = int(committed[0][5:])
    status = _status(run_dir)
    failed = status["failed"]
    assert (status["state"], failed["component"], failed["rank"]) == ("FAILED", "actor", 0), status
    assert "Killed" in failed["why"] and any("killing rank 0" in line for line in failed["tail"]), failed
    assert status["last_checkpoint_step"] == kept
    before = snapshot(run_dir, kept)

    # The same run, resumed as a new job that may requeue; USR2 (to the batch script, as Slurm's
    # --signal=B:USR2 sends it) once a resumed step is done.
    proc = cli("submit", "--resume", str(run_dir), "-P", "requeue=true", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = Job(JobRecord.load(run_dir))
    wait_for(lambda: len(events(run_dir, "first_step")) == 2, "a first resumed step", job=job)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True, timeout=30)
    assert job.wait(timeout_s=900, poll_s=0.5) == "COMPLETED", logs_text(run_dir)
    assert f"resuming from step {kept + 1} " in log.read_text()   # the previous checkpoint, not the torn one
    assert [e["step"] for e in events(run_dir, "requeued")] == [e["step"] for e in events(run_dir, "saved")]
    assert len(events(run_dir, "requeued")) == 1 and _status(run_dir)["requeues"] == 1
    assert_unchanged(before, snapshot(run_dir, kept))
    assert_same_final_state(run_dir, reference(), tmp_path)
