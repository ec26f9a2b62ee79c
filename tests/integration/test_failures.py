"""Failures on the real local Slurm cluster end in bounded time, never in a hang: a critic rank
killed -9 in the middle of a run (its component has two ranks), and a node lost (its slurmd
stopped). Both jobs run side by side (two nodes each)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess

import psutil
import pytest

from slurm_align.config import load_profile
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry
from tests.cluster import procs
from tests.cluster.cluster import SLURMD
from tests.integration.test_ppo import tiny_run
from tests.support.preempt_support import cli, logs_text, wait_for

TWO_BY_TWO = ["components.actor.nodes=1", "components.actor.tasks_per_node=2",
              "components.critic.nodes=1", "components.critic.tasks_per_node=2"]


def rank_process(run_dir, component: str, rank: int) -> psutil.Process:
    """The python process of `component` rank `rank` of this run (every slurmd is on this host)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if f"slurm_align.launchers.{component}" in cmd and str(run_dir) in cmd \
                    and p.environ().get("SLURM_PROCID") == str(rank):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process for {component} rank {rank} of {run_dir}")


def job_nodes(cluster, job_id: str) -> list[str]:
    """Node of each hetjob component, in component order."""
    out = cluster.run("scontrol", "show", "job", job_id, timeout=30).stdout
    return [line.split("=", 1)[1] for line in out.split() if line.startswith("NodeList=")]


@pytest.mark.slurm
def test_killed_critic_rank_and_lost_node_end_within_bounds(slurm_cluster, tmp_path):
    killed_dir, lost_dir = tmp_path / "killed", tmp_path / "lost"
    killed = launch_run(tiny_run("critic.data_parallel=2", "ppo.num_steps=20"),
                        load_profile("local-slurm", TWO_BY_TWO), killed_dir)
    hold = ["--hold-s", "3600"]   # far past every ceiling below: an undetected loss cannot pass
    lost = launch_run(tiny_run("actor.data_parallel=1"), load_profile("local-slurm", ["components.actor.nodes=1"]),
                      lost_dir, entry=Entry("report", {"actor": hold, "critic": hold}))

    # Node lost: once every rank reported, stop the critic node's slurmd (its ranks live on).
    wait_for(lambda: all((lost_dir / "reports" / c / "rank0.json").exists() for c in ("actor", "critic")),
             "the report ranks", job=lost)
    node = job_nodes(slurm_cluster, lost.job_id)[-1]
    procs.terminate([slurm_cluster.pids[node]])

    try:   # whatever fails below, the node comes back for the other tests
        # Critic rank 1 of 2 killed -9 in the middle of the run (after a whole step).
        wait_for(lambda: (killed_dir / "metrics.jsonl").exists() and (killed_dir / "metrics.jsonl").read_text(),
                 "a first PPO step", timeout=600, job=killed)
        rank_process(killed_dir, "critic", 1).send_signal(signal.SIGKILL)
        # Ceiling sized for a loaded 2-core machine; without the failure handling the actor would hang
        # on the dead critic rank's collective (or run its 20 steps), far past it.
        assert killed.wait(timeout_s=180, poll_s=0.2) == "FAILED", logs_text(killed_dir)
        status = json.loads(cli("status", str(killed_dir), "--json", timeout=60).stdout)
        failed = status["failed"]
        assert (status["state"], failed["component"], failed["rank"]) == ("FAILED", "critic", 1), status
        assert "Killed" in failed["why"] and failed["tail"], failed
        text = cli("status", str(killed_dir), timeout=60).stdout
        assert "critic failed first" in text and "rank 1" in text

        # Slurm notices the node after SlurmdTimeout; the ranks hold for an hour otherwise.
        assert lost.wait(timeout_s=300, poll_s=0.5) == "FAILED", logs_text(lost_dir)
    finally:   # the node comes back for the other tests (ReturnToService=2)
        for job in (killed, lost):   # a job still running would keep the node busy
            with contextlib.suppress(subprocess.CalledProcessError):   # scancel of an ended job
                job.cancel()
        slurm_cluster.pids[node] = procs.start_daemon(
            [SLURMD, "-D", "-N", node, "-f", str(slurm_cluster.conf_path)],
            slurm_cluster.log_dir / f"slurmd-{node}.out", slurm_cluster.env).pid
        wait_for(lambda: slurm_cluster.node_states().get(node) == "idle", f"{node} back to idle", timeout=120,
                 poll=0.5)


def local_rank_process(run_dir, component: str, rank: int) -> psutil.Process:
    """The python process of `component` rank `rank` of a run on the local profile (mpirun)."""
    def wanted(p: psutil.Process) -> bool:
        cmd = " ".join(p.info["cmdline"] or [])
        return (f"slurm_align.launchers.{component}" in cmd and str(run_dir) in cmd
                and p.environ().get("OMPI_COMM_WORLD_RANK") == str(rank))
    for p in psutil.process_iter(["cmdline"]):
        try:
            if wanted(p):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process for {component} rank {rank} of {run_dir}")


def test_killed_actor_ranks_fail_the_run_naming_the_rank(tmp_path):
    """kill -9 of an actor rank inside its MPI world, in the middle of a run, on the local profile
    (two runs side by side): a generation rank (rank 1) and rank 0, which also serves the prompts
    to the generation ranks (dynamic prompts). Each run FAILS, and `status` names the actor and
    the killed rank. Both are killed once their first step is done, that is while step 2 refits
    and generates (rank 0 handing out prompts)."""
    runs = {rank: tmp_path / f"rank{rank}" for rank in (1, 0)}
    jobs = {rank: launch_run(tiny_run("ppo.num_steps=50"), load_profile("local"), run_dir)
            for rank, run_dir in runs.items()}
    for rank, run_dir in runs.items():
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda m=metrics: m.exists() and m.read_text(), "a first PPO step", timeout=600, job=jobs[rank])
        local_rank_process(run_dir, "actor", rank).send_signal(signal.SIGKILL)
    for rank, run_dir in runs.items():
        # Ceiling for a loaded 2-core machine; 50 steps would take far longer, and a hang (the
        # other ranks waiting in a collective) lasts until pytest's timeout.
        assert jobs[rank].wait(timeout_s=300, poll_s=0.5) == "FAILED", logs_text(run_dir)
        status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
        failed = status["failed"]
        assert (status["state"], failed["component"], failed["rank"]) == ("FAILED", "actor", rank), status
        assert "Killed" in failed["why"] or "signal 9" in failed["why"], failed
