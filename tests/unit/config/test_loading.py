"""Bad input gets a ConfigError naming file, field, value and what is allowed — before any submit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align.config import ConfigError, check_against_profile, load_profile, load_run_config
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry, render_script

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _try_submit(config: Path, profile: str | Path, tmp_path: Path, overrides=(), profile_set=()):
    """The whole login-node path: load, validate, render, launch (which must not happen)."""
    run = load_run_config(config, list(overrides))
    prof = load_profile(str(profile), list(profile_set))
    check_against_profile(run, prof, config)
    return launch_run(run, prof, tmp_path / "run", entry=Entry("report"))


# (description, kwargs for _try_submit built from tmp_path, substrings the message must hold)
BAD_INPUTS = [
    ("unknown key", dict(overrides=["model.hiden_size=64"]), ["model.hiden_size", "unknown key"]),
    ("wrong type", dict(overrides=["model.num_layers=two"]), ["model.num_layers", "'two'", "integer"]),
    ("negative nodes", dict(profile="local-slurm", profile_set=["components.actor.nodes=-1"]),
     ["components.actor.nodes", "-1", "greater than or equal to 1"]),
    ("TP does not divide heads", dict(overrides=["actor.tensor_parallel=3", "actor.data_parallel=1"]),
     ["tensor_parallel=3", "num_attention_heads=4"]),
    ("PP does not divide layers", dict(overrides=["model.num_layers=3", "actor.pipeline_parallel=2",
                                                  "actor.data_parallel=1"]),
     ["pipeline_parallel=2", "num_layers=3"]),
    ("TPxPPxDP != ranks", dict(overrides=["actor.data_parallel=3"]), ["1x1x3 = 3", "2 ranks"]),
    ("missing partition on a real profile", dict(profile="local-slurm", profile_set=["partition=null"]),
     ["partition", "actor, critic"]),
    ("shell metacharacters in an sbatch value", dict(profile="local-slurm", profile_set=["partition=x; rm -rf ~"]),
     ["partition", "x; rm -rf ~", "no spaces"]),
    ("unknown profile name", dict(profile="no-such-cluster"), ["no-such-cluster", "available:", "local-slurm"]),
    ("bad enum value", dict(overrides=["generation.engine=sglang"]), ["generation.engine", "sglang", "'vllm'"]),
    ("bad time format", dict(profile="local-slurm", profile_set=["time=soon"]), ["time", "soon", "HH:MM:SS"]),
    ("bad override syntax", dict(overrides=["model.num_layers"]), ["model.num_layers", "a.b.c=value"]),
    ("bad sbatch_extra key", dict(profile="local-slurm", profile_set=["sbatch_extra.BAD KEY=1"]),
     ["BAD KEY", "sbatch option name"]),
    ("missing data file", dict(overrides=["data.train_path=/no/such/prompts.jsonl"]),
     ["data.train_path", "/no/such/prompts.jsonl", "no such file"]),
    ("no training data", dict(overrides=["data.train_path=null"]), ["data.train_path", "required"]),
    ("bad secret name", dict(profile="local-slurm", profile_set=["secret_env=['MY-KEY']"]), ["MY-KEY"]),
    # Values that pass type validation but that the job cannot run with (once found mid-job):
    ("negative seed", dict(overrides=["seed=-7"]), ["seed", "-7", "from 0 to"]),
    ("rollouts not split over DP", dict(overrides=["ppo.num_rollout_samples=7"]),
     ["ppo.num_rollout_samples", "7", "multiple of actor.data_parallel=2"]),
    ("PPO optimizer batch not split over DP", dict(overrides=["ppo.num_rollout_samples=8", "ppo.global_batch_size=1"]),
     ["ppo.global_batch_size", "got 1", "multiple of actor.data_parallel=2"]),
    ("trainer batch not split over DP", dict(overrides=["algorithm=sft", "trainer.global_batch_size=7"]),
     ["trainer.global_batch_size", "7", "multiple of actor.data_parallel=2"]),
    ("prompt + new tokens > max_seq_len", dict(overrides=["generation.max_new_tokens=500"]),
     ["generation.max_new_tokens", "500", "longest prompt", "max_seq_len=32", "prompts.jsonl"]),
    ("TensorRT-LLM without GPUs", dict(overrides=["generation.engine=trtllm"]),
     ["generation.engine", "trtllm", "gpus_per_node=0"]),
    ("vLLM on CPU with a head dim its kernels lack", dict(overrides=["generation.engine=vllm"]),
     ["model.num_attention_heads", "head dim 16", "'vllm'", "actor", "no GPUs", "(32, 64"]),
    ("vLLM log-probs under top-k for rollout correction",
     dict(overrides=["generation.engine=vllm", "rollout_correction.mode=token_truncate", "generation.top_k=5"]),
     ["rollout_correction.mode='token_truncate'", "generation.engine='vllm'", "top_k=0"]),
    ("grace longer than the time limit", dict(profile="local-slurm", profile_set=["time=2", "signal_grace_s=300"]),
     ["signal_grace_s=300", "time='2'", "120 s"]),
    ("MoE top-1 routing normalised over one expert (the router gets no gradient)",
     dict(overrides=["model.num_experts=4", "model.moe_router_topk=1"]),
     ["model", "moe_router_topk=1", "moe_norm_topk_prob=true", "moe_norm_topk_prob=false"]),
    ("negative preemption grace", dict(profile="local-slurm", profile_set=["preempt_grace_s=-5"]),
     ["preempt_grace_s", "-5", "greater than or equal to 0"]),
]


@pytest.mark.parametrize("desc,kw,needles", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_error_and_submits_nothing(tmp_path, desc, kw, needles):
    kw = dict(kw)
    with pytest.raises(ConfigError) as info:
        _try_submit(kw.pop("config", EXAMPLE), kw.pop("profile", "local"), tmp_path, **kw)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{desc}: {needle!r} not in {msg!r}"
    assert not (tmp_path / "run").exists(), "nothing may be written or submitted on bad input"


def test_unreadable_file(tmp_path):
    cfg = _write(tmp_path, "locked.yaml", "algorithm: ppo\n")
    cfg.chmod(0)
    if os.access(cfg, os.R_OK):   # root reads anything: use a directory instead
        cfg = tmp_path / "a_directory.yaml"
        cfg.mkdir()
    with pytest.raises(ConfigError) as info:
        load_run_config(cfg)
    assert str(cfg) in str(info.value) and "cannot read" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_run_config(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_line(tmp_path):
    cfg = _write(tmp_path, "broken.yaml", "algorithm: ppo\nmodel:\n  num_layers: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(cfg)
    assert "broken.yaml" in str(info.value) and "YAML syntax error at line" in str(info.value)


def test_top_level_not_a_mapping(tmp_path):
    cfg = _write(tmp_path, "list.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_run_config(cfg)


def test_profile_from_user_folder_and_path(tmp_path, monkeypatch):
    mine = tmp_path / "profiles"
    mine.mkdir()
    (mine / "mycluster.yaml").write_text("kind: slurm\npartition: gpu\n")
    monkeypatch.setenv("SLURM_ALIGN_PROFILE_PATH", str(mine))
    assert load_profile("mycluster").partition == "gpu"
    assert load_profile(str(mine / "mycluster.yaml")).name == "mycluster"


def test_secret_value_never_rendered(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-value")
    run = load_run_config(EXAMPLE)
    prof = load_profile("local-slurm", ["secret_env=[WANDB_API_KEY]"])
    script = render_script(run, prof, tmp_path / "run", Entry("report"))
    assert "WANDB_API_KEY" in script and "s3cr3t-value" not in script
    assert "set -x" not in script


def test_cli_reports_config_error_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_align.cli", "submit", str(EXAMPLE), "--profile", "local",
         "--run-dir", str(tmp_path / "run"), "actor.data_parallel=5", "--entry", "report"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "actor" in proc.stderr and "1x1x5" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    afile = _write(tmp_path, "not-a-dir", "x")
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_align.cli", "submit", str(EXAMPLE), "--profile", "local", "--run-dir", str(afile),
         "--entry", "report"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "--run-dir" in proc.stderr and "existing file" in proc.stderr
    assert afile.read_text() == "x"
