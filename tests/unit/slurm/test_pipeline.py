"""Pipelines (slurm/pipeline.py) before anything reaches Slurm: references between stages,
dependencies, and the checks made on every stage before the first is queued. The real chain of
jobs runs in tests/integration/test_pipeline.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.commands import parse_after
from slurm_align.slurm.executor import HetjobExecutor
from slurm_align.slurm.launch import resolve_input_paths
from slurm_align.slurm.pipeline import RECORD, _resolve, load_pipeline, stage_profile, submit_pipeline

EXAMPLES = REPO_ROOT / "examples"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def test_the_example_pipeline_reads_the_sft_and_rm_stages_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)   # the example's data paths are relative to the repo root
    spec_path = EXAMPLES / "pipeline_tiny.yaml"
    runs, deps = _resolve(spec_path, load_pipeline(spec_path), tmp_path / "p")
    assert list(runs) == ["sft", "rm", "ppo"]
    assert deps == {"sft": [], "rm": [], "ppo": ["sft", "rm"]}
    assert runs["ppo"].model.init_checkpoint == tmp_path / "p" / "sft" / "checkpoints" / "sft"
    assert runs["ppo"].critic_model.init_checkpoint == tmp_path / "p" / "rm" / "checkpoints" / "rm"


def test_a_rollout_stage_checkpoint_is_its_actor_folder_and_after_adds_a_dependency(tmp_path):
    spec = _write(tmp_path, f"""stages:
  grpo: {{config: {EXAMPLES / 'grpo_tiny.yaml'}}}
  dpo:
    config: {EXAMPLES / 'dpo_tiny.yaml'}
    overrides: ["model.init_checkpoint={{grpo.checkpoint}}/iter_0000060"]
  again:
    config: {EXAMPLES / 'sft_tiny.yaml'}
    after: [dpo]
""")
    runs, deps = _resolve(spec, load_pipeline(spec), tmp_path / "p")
    assert runs["dpo"].model.init_checkpoint == tmp_path / "p" / "grpo" / "checkpoints" / "actor" / "iter_0000060"
    assert deps == {"grpo": [], "dpo": ["grpo"], "again": ["dpo"]}


@pytest.mark.parametrize("override, allowed", [
    ("model.init_checkpoint={ppo.checkpoint}", "a stage may refer only to the stages above it: sft"),
    ("model.init_checkpoint={nope.checkpoint}", "a stage may refer only to the stages above it: sft"),
    ("model.init_checkpoint={sft.weights}", "output 'weights' of a stage is not known"),
])
def test_a_bad_reference_names_file_field_value_and_what_is_allowed(tmp_path, override, allowed):
    spec = _write(tmp_path, f"""stages:
  sft: {{config: {EXAMPLES / 'sft_tiny.yaml'}}}
  ppo:
    config: {EXAMPLES / 'ppo_tiny.yaml'}
    overrides: ["{override}"]
""")
    with pytest.raises(ConfigError) as err:
        _resolve(spec, load_pipeline(spec), tmp_path / "p")
    msg = str(err.value)
    assert str(spec) in msg and "stages.ppo.overrides[0]" in msg and override in msg and allowed in msg


def test_every_stage_is_checked_before_the_first_is_queued(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    spec = _write(tmp_path, f"""stages:
  sft: {{config: {EXAMPLES / 'sft_tiny.yaml'}}}
  ppo:
    config: {EXAMPLES / 'ppo_tiny.yaml'}
    overrides: ["model.init_checkpoint={{sft.checkpoint}}", "data.train_path=/no/such/prompts.jsonl"]
""")
    with pytest.raises(ConfigError, match=r"data.train_path.*/no/such/prompts.jsonl.*no such file"):
        submit_pipeline(spec, load_profile("local-slurm"), tmp_path / "p")
    assert not (tmp_path / "p" / RECORD).exists() and not (tmp_path / "p" / "sft" / "job.json").exists()
    with pytest.raises(ConfigError, match="a pipeline chains Slurm jobs"):
        submit_pipeline(EXAMPLES / "pipeline_tiny.yaml", load_profile("local"), tmp_path / "q")


def test_a_missing_input_is_accepted_only_inside_the_run_of_a_job_it_starts_after(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    upstream = tmp_path / "sft"
    upstream.mkdir()
    (upstream / "job.json").write_text(json.dumps({"job_id": "12"}))
    run = load_run_config(EXAMPLES / "ppo_tiny.yaml", [f"model.init_checkpoint={upstream}/checkpoints/sft"])
    assert resolve_input_paths(run, after=["11", "12"]).model.init_checkpoint == upstream / "checkpoints" / "sft"
    with pytest.raises(ConfigError, match=r"model.init_checkpoint.*no such file"):
        resolve_input_paths(run, after=["13"])
    with pytest.raises(ConfigError, match=r"model.init_checkpoint.*no such file"):
        resolve_input_paths(run)


def test_after_becomes_an_afterok_dependency_that_cancels_on_failure(tmp_path):
    assert parse_after("12:13") == ["12", "13"]
    with pytest.raises(ConfigError, match="'--after': got '12,13'"):
        parse_after("12,13")
    command = HetjobExecutor(tmp_path, "#!/bin/bash\n", after=["12", "13"])._make_submission_command(tmp_path / "x")
    assert command == ["sbatch", "--dependency=afterok:12:13", "--kill-on-invalid-dep=yes", str(tmp_path / "x")]
    assert HetjobExecutor(tmp_path, "#!/bin/bash\n")._make_submission_command(tmp_path / "x") == \
        ["sbatch", str(tmp_path / "x")]


@pytest.mark.parametrize("override, where, allowed", [
    ("requeue=maybe", "stages.sft.profile.requeue", "valid boolean"),
    ("no_such_field=1", "stages.sft.profile.no_such_field", "unknown key"),
    ("kind=local", "stages.sft.profile.kind", "the pipeline's stages are Slurm jobs of one profile"),
    ("partition", "stages.sft.profile", "must look like a.b.c=value"),
])
def test_a_stage_profile_override_is_checked_and_named(tmp_path, override, where, allowed):
    spec_path = _write(tmp_path, f"""stages:
  sft: {{config: {EXAMPLES / 'sft_tiny.yaml'}, profile: [partition=preemptible, "{override}"]}}
""")
    spec = load_pipeline(spec_path)
    with pytest.raises(ConfigError) as err:
        stage_profile(load_profile("local-slurm"), spec, "sft", spec_path)
    msg = str(err.value)
    assert str(spec_path) in msg and where in msg and allowed in msg, msg


def test_a_stage_profile_overrides_the_pipelines_for_that_stage_only(tmp_path):
    spec_path = _write(tmp_path, f"""stages:
  sft: {{config: {EXAMPLES / 'sft_tiny.yaml'}, profile: [partition=preemptible, requeue=true,
                                                     components.actor.nodes=1]}}
  rm: {{config: {EXAMPLES / 'rm_tiny.yaml'}}}
""")
    spec, base = load_pipeline(spec_path), load_profile("local-slurm")
    sft = stage_profile(base, spec, "sft", spec_path)
    assert (sft.partition, sft.requeue, sft.components["actor"].nodes) == ("preemptible", True, 1)
    assert stage_profile(base, spec, "rm", spec_path) is base
    assert (base.partition, base.requeue, base.components["actor"].nodes) == ("debug", False, 2)


def test_a_restarted_stage_moves_only_the_dependents_waiting_on_its_failed_job(tmp_path, monkeypatch):
    """follow_restart's choices (the real move on Slurm: tests/integration/test_restart.py), with a
    scontrol that records its updates and says job 9 completed: b waits on the failed job 10 and on
    job 9 (done) and moves onto 20 alone; c, queued after a resume, waits on another job: untouched."""
    from slurm_align.slurm.launch import JobRecord
    from slurm_align.slurm.pipeline import PipelineRecord, StageRecord, follow_restart

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"""#!/bin/sh
if [ "$1" = show ]; then [ "$3" = 9 ] && echo "JobId=9 JobState=COMPLETED" || echo "JobId=$3 JobState=PENDING"
else echo "$@" >>{calls}; fi
""")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    root = tmp_path / "pipe"
    stages = {"a": ("10", [], []), "b": ("11", ["a"], ["10", "9"]), "c": ("12", ["a"], ["7"]), "d": ("13", [], [])}
    for name, (job_id, _, after) in stages.items():
        (root / name).mkdir(parents=True)
        JobRecord("slurm", job_id, str(root / name), ["actor"], "local-slurm", after=after).save()
    PipelineRecord("spec.yaml", "local-slurm",
                   [StageRecord(n, str(root / n), deps, job_id) for n, (job_id, deps, _) in stages.items()]).save(root)

    assert follow_restart(root / "a", "10", "20") == ["stage b (job 11) now waits for job 20"]
    assert calls.read_text().splitlines() == ["update JobId=11 Dependency=afterok:20"]
    assert [JobRecord.load(root / n).after for n in "bcd"] == [["20"], ["7"], []]
    assert [s.job_id for s in PipelineRecord.load(root).stages] == ["20", "11", "12", "13"]
    assert follow_restart(tmp_path / "not-a-stage", "10", "20") == []
