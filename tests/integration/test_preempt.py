"""Preemption, time limits and a kill during a checkpoint write, on the real local Slurm cluster:
one run through the whole chain, ending as the uninterrupted reference run does.

kill -9 of actor rank 0 during a checkpoint write (FAILED; the torn checkpoint is never used)
-> resumed as a job that may requeue once: USR2 from `scancel --batch` after its first step
   (checkpoint, requeue as the same job)
-> the requeued job's time limit, lowered to 3 minutes: Slurm's own warning (--signal=B:USR2@110)
   (checkpoint; max_requeues reached: STOPPED)
-> `submit --resume`: completes.
Same seeds and static prompts, so the end state (every step stored once, metrics continuous,
final actor weights and AdamW state, critic weights) equals the reference's within 1e-5. Signals
and kills are triggered on observed events (a checkpoint being written, a first step done), never
after a sleep, and the actor holds after each job's first step until its stop request came
(tests/programs/preempt_hold_actor.py), so no job can finish before its signal.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurm_align.config import load_profile
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry
from tests.integration.test_ppo import tiny_run
from tests.support.preempt_support import (
    HOLD_ACTOR,
    assert_same_final_state,
    assert_unchanged,
    cli,
    events,
    logs_text,
    snapshot,
    wait_for,
)

FAULTY_ACTOR = Path(__file__).parents[1] / "programs" / "preempt_faulty_actor.py"


def _status(run_dir: Path) -> dict:
    proc = cli("status", str(run_dir), "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slurm
@pytest.mark.timeout(1500)   # two or more end-to-end runs: a hang guard sized for a loaded 2-core machine
def test_kill_during_checkpoint_write_then_usr2_and_time_limit_requeues_then_resume_completes(
        slurm_cluster, ppo_reference, tmp_path):
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "actor" / "rank0.log"

    # 1. Rank 0 of the actor is killed -9 while its second checkpoint is written.
    job = launch_run(tiny_run(*ppo_reference.overrides), load_profile("local-slurm"), run_dir,
                     entry=Entry(scripts={"actor": FAULTY_ACTOR}))
    wait_for(lambda: log.exists() and "killing rank 0" in log.read_text(), "the kill", job=job)
    # Ceiling for a loaded 2-core machine; without failure handling the other ranks hang in a
    # collective with the dead rank until pytest's timeout.
    assert job.wait(timeout_s=300, poll_s=0.2) == "FAILED", logs_text(run_dir)
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

    # 2. Resumed as a job that may requeue once; USR2 to its batch script (as Slurm's
    # --signal=B:USR2 sends it) once its first step is done (the actor holds there until then).
    (run_dir / "test_hold").write_text("stop")
    profile = load_profile("local-slurm", ["requeue=true", "max_requeues=1", "time=10", "signal_grace_s=110"])
    job = launch_run(tiny_run(*ppo_reference.overrides), profile, run_dir, entry=Entry(scripts={"actor": HOLD_ACTOR}))
    wait_for(lambda: f"holding after step {kept + 1} " in log.read_text(), "the resumed job's first step", job=job)
    subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True, timeout=30)
    # 3. Once it requeued, the job's time limit drops to 3 minutes: the requeued job gets Slurm's
    # warning 110 s before it (70 s in, or up to Slurm's next periodic check later), and holds
    # after its first step until then. The 110 s left after the warning are for a loaded 2-core
    # machine to end the step, save and exit before Slurm's kill.
    wait_for(lambda: events(run_dir, "requeued"), "the requeue", job=job)
    slurm_cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=3", timeout=30)
    assert job.wait(timeout_s=900, poll_s=0.5) == "STOPPED", logs_text(run_dir)

    saved = [e["step"] for e in events(run_dir, "saved")]
    assert saved == [kept + 1, kept + 2], saved                     # one step per job, then the stop
    assert [e["step"] for e in events(run_dir, "requeued")] == saved[:1]      # then max_requeues
    assert [e["signal"] for e in events(run_dir, "stop_requested")] == ["USR2", "USR2"]
    assert (run_dir / "requeue_count").read_text().strip() == "1"
    status = _status(run_dir)
    assert (status["state"], status["requeues"], status["stopped_at_step"], status["last_checkpoint_step"]) == \
        ("STOPPED", 1, saved[-1], saved[-1])
    out = "".join(p.read_text() for p in (run_dir / "logs").glob("job-*.out"))
    assert f"stopped for preemption at step {saved[0]}; requeueing" in out
    assert f"stopped for preemption at step {saved[-1]} (resume" in out

    # 4. `submit --resume` (the stock actor) completes the run.
    (run_dir / "test_hold").unlink()
    proc = cli("submit", "--resume", str(run_dir), "-P", "time=10", "--follow", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs_text(run_dir)
    text = log.read_text()
    for step in (kept, *saved):   # each start names the checkpoint it goes on from, never the torn one
        assert f"resuming from step {step + 1} " in text
    assert_unchanged(before, snapshot(run_dir, kept))   # the steps before the kill were not redone
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)
