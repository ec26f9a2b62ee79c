"""Restart on failure on the real local Slurm cluster: an SFT rank killed -9 with
fault_tolerance.max_restarts=1 brings the run back once, in a new job that excludes the killed
rank's node, resumed from its newest checkpoint, and it completes with every step logged once.
(Which failures are not retried: tests/unit/slurm/test_restart.py.)"""

from __future__ import annotations

import json
import signal

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import launch_run
from tests.integration.test_failures import rank_process
from tests.support.preempt_support import cli, logs_text, wait_for

SYNTH = REPO_ROOT / "examples" / "synthetic"
STEPS = 6


@pytest.mark.slurm
def test_a_killed_rank_restarts_once_without_its_node(slurm_cluster, tmp_path):
    run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={SYNTH / 'sft_train.jsonl'}", "data.val_path=null", f"trainer.num_steps={STEPS}",
        "trainer.save_interval=1", "fault_tolerance.max_restarts=1"])
    run_dir = tmp_path / "run"
    job = launch_run(run, load_profile("local-slurm"), run_dir)   # actor: 2 nodes, 1 rank each
    first_job = job.job_id
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, "two SFT steps",
             timeout=300, job=job)
    victim = rank_process(run_dir, "train", 1)
    node = victim.environ()["SLURMD_NODENAME"]
    victim.send_signal(signal.SIGKILL)
    assert job.wait(timeout_s=300, poll_s=0.5) == "COMPLETED", logs_text(run_dir)

    restarts = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1, restarts
    r = restarts[0]
    assert (r["retry"], r["count"], r["job_id"], r["component"], r["rank"], r["nodes"]) == \
        (True, 1, first_job, "actor", 1, [node]), r
    assert job.job_id == r["new_job_id"] != first_job
    shown = slurm_cluster.run("scontrol", "show", "job", job.job_id, timeout=30).stdout
    used = next(w.split("=", 1)[1] for w in shown.split() if w.startswith("NodeList="))
    assert node not in slurm_cluster.run("scontrol", "show", "hostnames", used, timeout=30).stdout.split(), shown
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps   # the redone step is stored once
    assert "resumed from" in (run_dir / "logs" / "actor" / "rank0.log").read_text()
    status = json.loads(cli("status", str(run_dir), "--json", timeout=60).stdout)
    assert status["state"] == "COMPLETED" and [x["new_job_id"] for x in status["restarts"]] == [job.job_id]
