"""Preemption the way Slurm does it, and the restarts it leads to.

Slurm's own preemption (PreemptMode=REQUEUE, GraceTime) sends SIGTERM to every step's tasks at
once and to the batch shell only when GraceTime is over (shared/STACK.md, turn 3): the ranks must
catch it themselves. A requeue is a new start of the same job id (SLURM_RESTART_COUNT): nothing
the previous start published may be trusted by the next.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from slurm_align.config import load_profile
from slurm_align.critic.client import CriticUnavailableError
from slurm_align.rundir import START_ENV, RunDir, publish_critic_address, read_run_secret
from slurm_align.slurm.launch import launch_run
from tests.critic_support import client_for, write_run_dir
from tests.preempt_support import (
    DETERMINISTIC, assert_same_final_state, assert_unchanged, cli, events, logs_text, snapshot, wait_for,
)
from tests.test_ppo import tiny_run


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


# --- Slurm's own preemption on the test cluster ------------------------------------------------
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


def _job_nodes(job_id: str) -> list[str]:
    """The nodes of every component of a (het)job, as Slurm's hostlist expands them."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    hosts = subprocess.run(["scontrol", "show", "hostnames", ",".join(out.split())], capture_output=True,
                           text=True, check=True, timeout=30).stdout.split()
    return sorted(set(hosts))


@pytest.mark.slurm
@pytest.mark.slow
def test_partition_preemption_saves_requeues_and_completes(slurm_cluster, reference, tmp_path):
    """A PPO hetjob on `preemptible` (PreemptMode=REQUEUE, GraceTime=60), requeue true; once a
    step is done, a job on `urgent` (higher PriorityTier) asks for its nodes. Slurm sends SIGTERM to
    every step: the actor stops at once at its newest checkpoint (the step in flight is redone
    later), the job is requeued (SLURM_RESTART_COUNT=1), it resumes once the urgent job is over
    and completes as the uninterrupted run does: every step once, the same final weights."""
    run_dir = tmp_path / "run"
    profile = load_profile("local-slurm", ["partition=preemptible", "requeue=true", "max_requeues=2"])
    job = launch_run(tiny_run(*DETERMINISTIC), profile, run_dir)
    wait_for(lambda: list((run_dir / "checkpoints" / "actor").glob("iter_*/manifest.json")), "a first checkpoint",
             job=job)
    nodes = _job_nodes(job.job_id)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N", str(len(nodes)),
                             f"--nodelist={','.join(nodes)}", "-o", str(tmp_path / "urgent-%j.out"),
                             "--wrap", "sleep 2"], capture_output=True, text=True, check=True, timeout=30)
    urgent_id = urgent.stdout.strip()
    saved = wait_for(lambda: events(run_dir, "saved"), "the save after Slurm's SIGTERM", timeout=120, job=job)
    assert saved[0]["by"] == "TERM", saved
    stopped_at = saved[0]["step"]
    before = snapshot(run_dir, stopped_at)
    # Slurm requeues the job itself; it starts again (restart count 1) when the urgent job is done
    wait_for(lambda: [e for e in events(run_dir, "started") if e["restart_count"] == 1], "the requeued start",
             timeout=300)
    assert job.wait(timeout_s=900, poll_s=0.5) == "COMPLETED", logs_text(run_dir)

    # the job ended within GraceTime, so Slurm leaves the requeue to the script: once, by TERM
    assert [(e["step"], e["count"], e["by"]) for e in events(run_dir, "requeued")] == [(stopped_at, 1, "TERM")]
    assert len(events(run_dir, "term_received")) == 1
    state = subprocess.run(["scontrol", "show", "job", urgent_id], capture_output=True, text=True, timeout=30).stdout
    assert "JobState=COMPLETED" in state, state
    status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
    assert (status["state"], status["requeues"]) == ("COMPLETED", 1), status
    log = (run_dir / "logs" / "actor" / "rank0.log").read_text()
    assert f"resuming from step {stopped_at + 1} " in log
    assert_unchanged(before, snapshot(run_dir, stopped_at))   # the saved steps were not redone
    assert_same_final_state(run_dir, reference(), tmp_path)
