"""Preemption the way Slurm does it, and the restarts it leads to.

Slurm's own preemption (PreemptMode=REQUEUE, GraceTime) sends SIGTERM to every step's tasks at
once and to the batch shell only when GraceTime is over (shared/STACK.md, turn 3): the ranks must
catch it themselves. A requeue is a new start of the same job id (SLURM_RESTART_COUNT): nothing
the previous start published may be trusted by the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile
from slurm_align.critic.client import CriticUnavailableError
from slurm_align.rundir import START_ENV, RunDir, publish_critic_address, read_run_secret
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.preemption import GRACE_ENV, read_events
from slurm_align.slurm.render import Entry
from tests.integration.test_ppo import tiny_run
from tests.support.critic_support import client_for, write_run_dir
from tests.support.preempt_support import (
    assert_same_final_state,
    assert_unchanged,
    cli,
    events,
    logs_text,
    snapshot,
    wait_for,
)

STOP_THEN_LINGER = REPO_ROOT / "tests" / "programs" / "stop_then_linger.py"


class StrangerListener:
    """A plain TCP listener (port 0, bound before anyone learns the port) that records every
    connection it gets: what another process on the node would be, once the previous start's
    critic has gone and its host:port was taken."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stranger():
    listener = StrangerListener()
    yield listener
    listener.close()


def _plant_previous_start_address(run_dir, port, monkeypatch, start="4242:0"):
    """The address the previous start's critic left: tagged with the run's own secret (the
    critic of that start wrote it), for host:port where a stranger listens now."""
    rd = RunDir(run_dir)
    monkeypatch.setenv(START_ENV, start)
    publish_critic_address(rd, "127.0.0.1", port, read_run_secret(rd))


def test_requeued_actor_never_connects_to_the_previous_starts_address(tmp_path, stranger, monkeypatch):
    run_dir = write_run_dir(tmp_path / "run")
    _plant_previous_start_address(run_dir, stranger.port, monkeypatch, start="4242:0")
    monkeypatch.setenv(START_ENV, "4242:1")   # Slurm requeued the job: restart count 1
    client = client_for(run_dir, connect_timeout_s=1.5)
    with pytest.raises(CriticUnavailableError) as info:
        client.connect()
    client.close()
    msg = str(info.value)
    assert "from start 4242:0" in msg and "this is start 4242:1" in msg and "not used" in msg, msg
    assert stranger.connections == 0, "the actor connected to an address of an earlier start"


def test_the_same_start_does_use_its_address(tmp_path, stranger, monkeypatch):
    """The check above can fail: with the start unchanged the client does go to that address."""
    run_dir = write_run_dir(tmp_path / "run")
    _plant_previous_start_address(run_dir, stranger.port, monkeypatch, start="4242:1")
    client = client_for(run_dir, connect_timeout_s=1.5)
    with pytest.raises(CriticUnavailableError):
        client.connect()   # the stranger speaks no HTTP
    client.close()
    assert stranger.connections >= 1


def _term_stop_worker(tmp_path: Path, grace: float, *args) -> tuple[subprocess.CompletedProcess, RunDir]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "SLURM_JOB_ID": "1", GRACE_ENV: str(grace), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.programs.term_stop_worker", str(run_dir), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, RunDir(run_dir)


# --- the actor's choice at a TERM: finish the step in flight, or stop at the last checkpoint ----
@pytest.mark.parametrize("grace,steps,term_step,stopped_at,finish,abandoned,within_s", [
    # the previous step (0.3 s) fits in 60 s: step 3 is finished and the loop stops at its boundary
    (60, "0.3,0.3,0.3,0.3", 3, 3, True, None, 30),
    # 3 s of grace is less than the exit margin: at once, at the newest checkpoint (step 2)
    (3, "0.3,0.3,6,0.3", 3, 2, False, True, 3),
    # the previous step took 2 s, more than 6 s - 5 s: at once, step 3 is given up
    (6, "0.3,2,6,0.3", 3, 2, False, True, 3),
    # the previous step fitted but this one takes 8 s: given up at the deadline (6 s - 5 s)
    (6, "0.3,0.3,8,0.3", 3, 2, True, True, 4),
], ids=["finishes", "no-grace", "too-slow-before", "deadline"])
def test_term_finishes_the_step_in_flight_only_within_preempt_grace(tmp_path, grace, steps, term_step, stopped_at,
                                                                   finish, abandoned, within_s):
    """Real signals on a real StopPoint (one rank, COMM_SELF) with SIGTERM blocked as under Slurm."""
    proc, rd = _term_stop_worker(tmp_path, grace, steps, term_step)
    term, = [e for e in read_events(rd) if e["event"] == "term_received"]
    saved, = [e for e in read_events(rd) if e["event"] == "saved"]
    assert (term["in_flight"], term["finish"]) == (term_step, finish), term
    assert (saved["step"], saved["by"], saved.get("abandoned")) == (stopped_at, "TERM", abandoned), saved
    assert rd.stopped_step.read_text().strip() == str(stopped_at)
    assert rd.stopped_by.read_text().strip() == "TERM"
    assert ("stopped at the boundary" in proc.stdout) == (abandoned is None), proc.stdout
    assert saved["time"] - term["time"] < within_s   # the stop came when it had to, not at the step's end


def test_term_in_the_last_step_lets_the_run_complete(tmp_path):
    """A TERM during the last step that fits: the run completes; the deadline passing during the
    actor's shut-down does not turn it into a stop (no stopped_step, nothing to requeue)."""
    proc, rd = _term_stop_worker(tmp_path, 6, "0.3,0.3,0.3", 3, 2.5)   # deadline 1 s after the TERM
    assert "ran to the end" in proc.stdout, proc.stdout + proc.stderr
    assert [e["event"] for e in read_events(rd)] == ["first_step", "term_received"]
    assert not rd.stopped_step.exists()


# --- Slurm's own preemption on the test cluster ------------------------------------------------
HOLD_ACTOR = Path(__file__).parents[1] / "programs" / "preempt_hold_actor.py"
GRACE = "preempt_grace_s=60"   # the partition's GraceTime (tests/cluster/slurm.conf.template)


def _job_nodes(job_id: str) -> list[str]:
    """The nodes of every component of a (het)job, as Slurm's hostlist expands them."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    hosts = subprocess.run(["scontrol", "show", "hostnames", ",".join(out.split())], capture_output=True,
                           text=True, check=True, timeout=30).stdout.split()
    return sorted(set(hosts))


def _preempt(job, tmp_path: Path) -> str:
    """A job on `urgent` (higher PriorityTier) that needs all of `job`'s nodes: Slurm preempts."""
    nodes = _job_nodes(job.job_id)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N", str(len(nodes)),
                             f"--nodelist={','.join(nodes)}", "-o", str(tmp_path / "urgent-%j.out"),
                             "--wrap", "sleep 2"], capture_output=True, text=True, check=True, timeout=30)
    return urgent.stdout.strip()


def _scontrol_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(1500)   # three starts and two preemptions: a hang guard for a loaded 2-core machine
def test_partition_preemption_finishes_the_step_in_flight_stops_then_requeues_and_completes(
        slurm_cluster, ppo_reference, tmp_path):
    """A PPO hetjob on `preemptible` (PreemptMode=REQUEUE, GraceTime=60, preempt_grace_s=60),
    preempted twice by a job on `urgent` (higher PriorityTier) that asks for its nodes. Slurm
    sends SIGTERM to every task of every step at once; the actor holds mid-step until its TERM
    came (tests/programs/preempt_hold_actor.py "term"), then finishes that step (the critic trains and saves
    after the TERM: it survived it) and saves it, so no step is redone.
    1. requeue false: the job ends STOPPED (exit 75), status says STOPPED at step 1;
    2. resumed with requeue true: stopped at step 2 the same way, requeued (SLURM_RESTART_COUNT=1),
       it resumes at step 3 once the urgent job is over and completes as the uninterrupted run:
       every step once, the same final weights."""
    run_dir = tmp_path / "run"
    log = run_dir / "logs" / "actor" / "rank0.log"
    hold = Entry(scripts={"actor": HOLD_ACTOR})

    # 1. requeue false
    profile = load_profile("local-slurm", ["partition=preemptible", "requeue=false", GRACE])
    job = launch_run(tiny_run(*ppo_reference.overrides), profile, run_dir, entry=hold)
    (run_dir / "test_hold").write_text("term")   # read at the first step, long after the submit
    wait_for(lambda: log.exists() and "holding in step 1 " in log.read_text(), "the first step", job=job)
    first_urgent = _preempt(job, tmp_path)
    assert job.wait(timeout_s=300, poll_s=0.5) == "STOPPED", logs_text(run_dir)
    term = events(run_dir, "term_received")
    assert [(e["in_flight"], e["finish"]) for e in term] == [(1, True)], term
    assert [(e["step"], e["by"], e.get("abandoned")) for e in events(run_dir, "saved")] == [(1, "TERM", None)]
    assert (run_dir / "checkpoints" / "actor" / "iter_0000001" / "manifest.json").is_file()
    assert (run_dir / "checkpoints" / "critic" / "iter_0000001.pt").is_file()   # saved after its TERM
    assert "ExitCode=75:0" in _scontrol_job(job.job_id)
    assert not events(run_dir, "requeued")
    status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
    assert (status["state"], status["stopped_at_step"], status["last_checkpoint_step"]) == ("STOPPED", 1, 1), status
    critic_log = (run_dir / "logs" / "critic" / "rank0.log").read_text()
    assert "SIGTERM received (preemption?): serving on" in critic_log and "the actor stopped" in critic_log
    before = snapshot(run_dir, 1)

    # 2. resumed (the hold actor, as `submit --resume` would start the stock one) with requeue true
    profile = load_profile("local-slurm", ["partition=preemptible", "requeue=true", "max_requeues=1", GRACE])
    job = launch_run(tiny_run(*ppo_reference.overrides), profile, run_dir, entry=hold)
    wait_for(lambda: "holding in step 2 " in log.read_text(), "the resumed job's first step", job=job)
    urgent_id = _preempt(job, tmp_path)
    saved = wait_for(lambda: events(run_dir, "saved")[1:], "the save after Slurm's SIGTERM", timeout=120, job=job)
    assert [(e["step"], e["by"], e.get("abandoned")) for e in saved] == [(2, "TERM", None)]
    wait_for(lambda: [e for e in events(run_dir, "started") if e["restart_count"] == 1], "the requeued start",
             timeout=300)
    assert job.wait(timeout_s=900, poll_s=0.5) == "COMPLETED", logs_text(run_dir)

    assert [(e["in_flight"], e["finish"]) for e in events(run_dir, "term_received")] == [(1, True), (2, True)]
    # the job ended within GraceTime, so Slurm leaves the requeue to the script: once, by TERM
    assert [(e["step"], e["count"], e["by"]) for e in events(run_dir, "requeued")] == [(2, 1, "TERM")]
    for urgent in (first_urgent, urgent_id):
        assert "JobState=COMPLETED" in _scontrol_job(urgent)
    status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
    assert (status["state"], status["requeues"]) == ("COMPLETED", 1), status
    text = log.read_text()
    assert "resuming from step 2 " in text and "resuming from step 3 " in text
    assert "resuming from step 1 " not in text and text.count("resuming from step 2 ") == 1
    assert_unchanged(before, snapshot(run_dir, 1))   # the step finished after the TERM was not redone
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)


def test_a_job_killed_while_its_components_end_after_the_actors_stop_reads_stopped(tmp_path):
    """Once the actor stopped at a checkpoint, the job script ends the other components and
    waits for them (the critic's server takes seconds, up to Triton's 30 s exit timeout); the
    time limit's kill may end the whole job meanwhile (Slurm's KillWait: seconds). The stop is
    recorded before that wait, so the job reads STOPPED, not FAILED (CI: the preemption chain's
    job read FAILED while its actor had stopped and saved). Deterministic: the critic's launcher
    is frozen, so the script waits for it until the test kills the job as the time limit does."""
    run_dir = tmp_path / "run"
    job = launch_run(tiny_run(), load_profile("local"), run_dir,
                     entry=Entry(scripts={"actor": STOP_THEN_LINGER, "critic": STOP_THEN_LINGER}))
    script = psutil.Process(job.record.pid)
    try:
        wait_for(lambda: (run_dir / "test_critic_up").exists(), "the critic", job=job)
        [launcher] = [p for p in script.children() if p.environ().get("SLURM_ALIGN_COMPONENT") == "critic"]
        launcher.suspend()          # its TERM from the script waits, and the script waits for it
        (run_dir / "test_go").write_text("")
        out = run_dir / "logs" / "job-local.out"
        # Not wait_for(job=job): the script records the stop (the job reads STOPPED) just before
        # it prints this line and waits for the frozen critic, and a poll between the two would
        # take STOPPED for the end of the job (CI failed so once). An ended job still stops the wait.
        wait_for(lambda: "ending the other components" in out.read_text()
                 or job.state() in ("FAILED", "CANCELLED", "COMPLETED"), "the actor's stop")
        assert "ending the other components" in out.read_text(), logs_text(run_dir)
    finally:
        for p in [script, *script.children(recursive=True)]:   # the time limit's kill, of all at once
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        job.wait(timeout_s=60)
    codes = {c: p.read_text().strip() if (p := run_dir / "logs" / c / "exit_code").exists() else None
             for c in job.record.components}
    assert job.state() == "STOPPED", codes
    status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
    assert (status["state"], status["stopped_at_step"]) == ("STOPPED", 3), status
