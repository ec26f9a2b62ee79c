"""Restart on failure on the real local Slurm cluster: an SFT rank killed -9 with
fault_tolerance.max_restarts=1 brings the run back once, in a new job that excludes the killed
rank's node, resumed from its newest checkpoint, and it completes with every step logged once.
The run is the first stage of a pipeline: its dependent stage, queued `afterok` on the first
job id, follows the new job (slurm/restart.py moves its dependency) and runs after it from its
checkpoint instead of being cancelled by Slurm. (Which failures are not retried:
tests/unit/slurm/test_restart.py.)"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile
from slurm_align.slurm.launch import Job, JobRecord
from slurm_align.slurm.pipeline import submit_pipeline
from tests.integration.test_failures import rank_process
from tests.integration.test_pipeline import job_times
from tests.support.preempt_support import cli, logs_text, wait_for

EXAMPLES = REPO_ROOT / "examples"
SYNTH = EXAMPLES / "synthetic"
STEPS = 6


def _pipeline(tmp_path: Path) -> Path:
    data = [f"data.train_path={SYNTH / 'sft_train.jsonl'}", "data.val_path=null"]
    stages = {
        "sft": {"config": str(EXAMPLES / "sft_tiny.yaml"),   # actor: 2 nodes, 1 rank each
                "overrides": [*data, f"trainer.num_steps={STEPS}", "trainer.save_interval=1",
                              "fault_tolerance.max_restarts=1"]},
        # the cheapest reader of its checkpoint: one SFT step on one rank
        "next": {"config": str(EXAMPLES / "sft_tiny.yaml"),
                 "overrides": [*data, "model.init_checkpoint={sft.checkpoint}", "actor.data_parallel=1",
                               "trainer.num_steps=1", "trainer.save_interval=0", "trainer.global_batch_size=2",
                               "trainer.micro_batch_size=2"],
                 "profile": ["components.actor.nodes=1"]},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps({"stages": stages}))   # YAML is a superset of JSON
    return path


@pytest.mark.slurm
def test_a_killed_rank_restarts_once_without_its_node_and_its_dependent_stage_follows(slurm_cluster, tmp_path):
    root = tmp_path / "pipe"
    record = submit_pipeline(_pipeline(tmp_path), load_profile("local-slurm"), root)
    first_job, next_job = (s.job_id for s in record.stages)
    run_dir = root / "sft"
    job = Job(JobRecord.load(run_dir))
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

    # The dependent stage was moved onto the new job before the failed one ended: Slurm did not
    # cancel it, it started after the restarted stage completed, from its newest checkpoint.
    assert r["dependents"] == [f"stage next (job {next_job}) now waits for job {job.job_id}"], r
    after = Job(JobRecord.load(root / "next"))
    assert after.job_id == next_job and after.wait(timeout_s=300, poll_s=0.5) == "COMPLETED", \
        logs_text(root / "next")
    assert after.record.after == [job.job_id]
    assert job_times(next_job)[0] >= job_times(job.job_id)[1]
    assert f"init_checkpoint: {run_dir / 'checkpoints' / 'sft'}" in (root / "next" / "config.yaml").read_text()
    pipeline = {s["name"]: s for s in json.loads(cli("status", str(root), "--json", timeout=60).stdout)["stages"]}
    assert {n: (s["job_id"], s["state"]) for n, s in pipeline.items()} == {
        "sft": (job.job_id, "COMPLETED"), "next": (next_job, "COMPLETED")}, pipeline
    assert json.loads((root / "pipeline.json").read_text())["stages"][0]["job_id"] == job.job_id
