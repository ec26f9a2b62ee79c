"""A pipeline on the real local Slurm cluster: SFT -> RM -> PPO queued in one call, each stage
starting only after the stages it reads from completed; a failing first stage leaves its
dependents cancelled by Slurm, with the reason in `slurm-align status`, and `pipeline --resume`
queues them again. One chain of jobs covers both paths (the suite's time on the cluster)."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.slurm.launch import Job, JobRecord

EXAMPLES = REPO_ROOT / "examples"
SYNTH = EXAMPLES / "synthetic"
TRAIN = ["trainer.num_steps=2", "trainer.save_interval=0", "trainer.global_batch_size=4",
         "trainer.micro_batch_size=2"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _spec(tmp_path: Path, sft_train: Path) -> Path:
    stages = {
        "sft": {"config": str(EXAMPLES / "sft_tiny.yaml"),
                "overrides": [f"data.train_path={sft_train}", f"data.val_path={SYNTH / 'sft_val.jsonl'}", *TRAIN]},
        "rm": {"config": str(EXAMPLES / "rm_tiny.yaml"),
               "overrides": [f"data.train_path={SYNTH / 'pref_train.jsonl'}",
                             f"data.val_path={SYNTH / 'pref_val.jsonl'}", *TRAIN]},
        "ppo": {"config": str(EXAMPLES / "ppo_tiny.yaml"),
                "overrides": ["model.init_checkpoint={sft.checkpoint}", "critic_model.init_checkpoint={rm.checkpoint}",
                              f"data.train_path={SYNTH / 'prompts.jsonl'}", "ppo.num_steps=1",
                              "ppo.num_rollout_samples=4", "generation.max_new_tokens=4",
                              "generation.prompt_batch_size=2", "ppo.train_micro_batch_size=2"]},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps({"stages": stages}))   # YAML is a superset of JSON
    return path


def job_times(job_id: str) -> tuple[dt.datetime, dt.datetime]:
    """(start, end) of a finished job, from scontrol (no accounting here; MinJobAge keeps them)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    found = {k: re.search(rf"\b{k}=(\S+)", text) for k in ("StartTime", "EndTime")}
    assert all(found.values()), text
    return dt.datetime.fromisoformat(found["StartTime"].group(1)), dt.datetime.fromisoformat(found["EndTime"].group(1))


def _stages(root: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((root / "pipeline.json").read_text())["stages"]}


@pytest.mark.slurm
def test_a_pipeline_queues_at_once_cancels_after_a_failure_and_resume_runs_each_stage_after_its_inputs(
        slurm_cluster, tmp_path):
    """One pipeline through both paths (one chain of jobs instead of two): SFT -> RM -> PPO queued
    in one call with Slurm's afterok dependencies; the SFT stage's data is broken, so it fails, RM
    (independent) completes and Slurm cancels PPO, which status explains; once the data is fixed
    `pipeline --resume` queues SFT and PPO again, and PPO starts only after both of its inputs
    ended and trains from their checkpoints."""
    broken = tmp_path / "broken.jsonl"
    # Valid when queued (submit reads a sample of the rows and would refuse a broken file), broken
    # when the stage's ranks read it: overwritten as soon as `pipeline` returns, long before the
    # SFT job's ranks have imported torch and open their data (seconds).
    broken.write_text((SYNTH / "sft_train.jsonl").read_text())
    root = tmp_path / "pipe"
    proc = _cli("pipeline", str(_spec(tmp_path, broken)), "--profile", "local-slurm", "--run-dir", str(root))
    broken.write_text("this is not JSON\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages = _stages(root)
    assert {n: s["after"] for n, s in stages.items()} == {"sft": [], "rm": [], "ppo": ["sft", "rm"]}
    # Queued with its dependency on both (before either ran: the dependency is Slurm's, not ours)
    dep = subprocess.run(["scontrol", "show", "job", stages["ppo"]["job_id"]], capture_output=True, text=True).stdout
    assert f"afterok:{stages['sft']['job_id']}" in dep and f"afterok:{stages['rm']['job_id']}" in dep, dep

    assert Job(JobRecord.load(root / "sft")).wait(timeout_s=600) == "FAILED"
    assert Job(JobRecord.load(root / "rm")).wait(timeout_s=900) == "COMPLETED"
    assert Job(JobRecord.load(root / "ppo")).wait(timeout_s=120) == "CANCELLED"
    status = {s["name"]: s for s in json.loads(_cli("status", str(root), "--json").stdout)["stages"]}
    assert {n: s["state"] for n, s in status.items()} == {"sft": "FAILED", "rm": "COMPLETED", "ppo": "CANCELLED"}
    assert status["ppo"]["why"].startswith("cancelled by Slurm: stage sft ended FAILED"), status

    # Once the input is fixed, --resume queues what did not complete (and what waits on it).
    broken.write_text((SYNTH / "sft_train.jsonl").read_text())
    old = {n: s["job_id"] for n, s in stages.items()}
    proc = _cli("pipeline", "--resume", str(root))
    assert proc.returncode == 0 and "queued again: sft, ppo" in proc.stdout, proc.stdout + proc.stderr
    stages = _stages(root)
    assert stages["sft"]["job_id"] != old["sft"] and stages["ppo"]["job_id"] != old["ppo"]
    assert stages["rm"]["job_id"] == old["rm"]   # completed: not run again
    for name in ("sft", "ppo"):
        job = Job(JobRecord.load(root / name))
        state = job.wait(timeout_s=900)
        assert state == "COMPLETED", (name, [p.read_text()[-2000:] for ps in job.failed_logs().values() for p in ps])
    ppo_start, _ = job_times(stages["ppo"]["job_id"])
    for name in ("sft", "rm"):
        assert ppo_start >= job_times(stages[name]["job_id"])[1], name
    # PPO loaded the SFT and RM stages' checkpoints (a missing one fails the job at load)
    config = (root / "ppo" / "config.yaml").read_text()
    assert f"init_checkpoint: {root / 'sft' / 'checkpoints' / 'sft'}" in config
    assert f"init_checkpoint: {root / 'rm' / 'checkpoints' / 'rm'}" in config
    status = json.loads(_cli("status", str(root), "--json").stdout)
    assert [(s["name"], s["state"]) for s in status["stages"]] == [
        ("sft", "COMPLETED"), ("rm", "COMPLETED"), ("ppo", "COMPLETED")]
    assert status["stages"][2]["last_checkpoint_step"] == 1


HOLD_ACTOR = REPO_ROOT / "tests" / "programs" / "preempt_hold_actor.py"
PREEMPTIBLE = ["partition=preemptible", "requeue=true", "max_requeues=1", "preempt_grace_s=60",
               "components.actor.nodes=1"]   # the partition's GraceTime (tests/cluster/slurm.conf.template)


@pytest.mark.slurm
def test_a_stage_preempted_and_requeued_still_releases_its_dependent(slurm_cluster, tmp_path):
    """A GRPO stage on `preemptible` (its own profile overrides) is preempted by an `urgent` job
    after its first step (the hold actor waits there for Slurm's SIGTERM), saves, is requeued
    under the same job id and completes; the stage after it (afterok) starts only once it
    completed, from its final checkpoint, and status shows both completed."""
    from slurm_align.config import load_profile
    from slurm_align.slurm.pipeline import submit_pipeline
    from slurm_align.slurm.render import Entry
    from tests.integration.test_slurm_preemption import _preempt
    from tests.support.preempt_support import events, logs_text, wait_for

    stages = {
        "grpo": {"config": str(EXAMPLES / "grpo_tiny.yaml"), "profile": PREEMPTIBLE,
                 "overrides": [f"data.train_path={SYNTH / 'prompts.jsonl'}", "actor.data_parallel=1",
                               "ppo.num_steps=2", "ppo.save_interval=1", "ppo.num_rollout_samples=2",
                               "rl.n_samples_per_prompt=2", "ppo.global_batch_size=4", "ppo.train_micro_batch_size=2",
                               "generation.max_new_tokens=4", "generation.prompt_batch_size=2", "eval.interval=0"]},
        "next": {"config": str(EXAMPLES / "sft_tiny.yaml"), "profile": ["components.actor.nodes=1"],
                 "overrides": [f"data.train_path={SYNTH / 'sft_train.jsonl'}", "data.val_path=null",
                               "model.init_checkpoint={grpo.checkpoint}", "actor.data_parallel=1",
                               "trainer.num_steps=1", "trainer.save_interval=0", "trainer.global_batch_size=2",
                               "trainer.micro_batch_size=2"]},
    }
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(json.dumps({"stages": stages}))
    root = tmp_path / "pipe"
    record = submit_pipeline(spec, load_profile("local-slurm"), root,
                             entries={"grpo": Entry(scripts={"actor": HOLD_ACTOR})})
    (root / "grpo" / "test_hold").write_text("term-after")   # read after the first step, long after this
    grpo_id, next_id = (s.job_id for s in record.stages)
    grpo = Job(JobRecord.load(root / "grpo"))
    assert "Partition=preemptible" in _scontrol(grpo_id) and "Partition=debug" in _scontrol(next_id)
    log = root / "grpo" / "logs" / "actor" / "rank0.log"
    wait_for(lambda: log.exists() and "holding after step 1 " in log.read_text(), "the first step", job=grpo)
    urgent = _preempt(grpo, tmp_path)
    after = Job(JobRecord.load(root / "next"))   # pending all along: its end fails the wait at once
    wait_for(lambda: [e for e in events(root / "grpo", "started") if e["restart_count"] == 1],
             "the requeued start", timeout=300, job=after)
    assert grpo.wait(timeout_s=300, poll_s=0.5) == "COMPLETED", logs_text(root / "grpo")
    assert after.wait(timeout_s=300, poll_s=0.5) == "COMPLETED", logs_text(root / "next")

    assert [(e["step"], e["count"], e["by"]) for e in events(root / "grpo", "requeued")] == [(1, 1, "TERM")]
    assert grpo.job_id == grpo_id and "Restarts=1" in _scontrol(grpo_id)   # requeued: the same job
    assert "resuming from step 2 " in log.read_text()
    # Slurm's record: the dependent started after the requeued stage's (second) end, and after the
    # urgent job that preempted it
    assert job_times(next_id)[0] >= job_times(grpo_id)[1] >= job_times(urgent)[1]
    assert f"init_checkpoint: {root / 'grpo' / 'checkpoints' / 'actor'}" in (root / "next" / "config.yaml").read_text()
    assert (root / "grpo" / "checkpoints" / "actor" / "iter_0000002" / "manifest.json").is_file()
    status = json.loads(_cli("status", str(root), "--json").stdout)
    assert [(s["name"], s["job_id"], s["state"]) for s in status["stages"]] == [
        ("grpo", grpo_id, "COMPLETED"), ("next", next_id, "COMPLETED")], status


def _scontrol(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
