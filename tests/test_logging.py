"""Metrics to TensorBoard and W&B (offline) besides metrics.jsonl: read back from the files the
libraries wrote, after a real tiny training run and across a resume."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig
from slurm_align.profiling.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parent.parent
LOGGING = {"tensorboard": True, "wandb": {"project": "slurm-align-tests", "mode": "offline"}}


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def wandb_run_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_tensorboard_and_wandb_offline_with_a_resume(tmp_path):
    run = RunConfig(logging=LOGGING)
    first = MetricsLogger(run, tmp_path)
    for step in range(4):
        first.log({"step": step, "loss": 10.0 + step, "note": "text is kept in the jsonl only"})
    first.close()
    # A resumed job redoes steps 2 and 3 with other values: each step is recorded once.
    again = MetricsLogger(run, tmp_path)
    again.start_at(2)
    for step in (2, 3):
        again.log({"step": step, "loss": 20.0 + step, "nan": float("nan")})
    again.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(0, 10.0), (1, 11.0), (2, 22.0), (3, 23.0)]
    assert scalars(tmp_path, "loss") == {0: 10.0, 1: 11.0, 2: 22.0, 3: 23.0}
    assert wandb_run_files(tmp_path) and all(p.stat().st_size > 0 for p in wandb_run_files(tmp_path))


def test_only_the_logging_rank_writes(tmp_path):
    quiet = MetricsLogger(RunConfig(logging=LOGGING), tmp_path, enabled=False)
    quiet.start_at(0)
    quiet.log({"step": 0, "loss": 1.0})
    quiet.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is not None, reason="mlflow is installed here")
def test_missing_tracking_library_is_a_clear_error(tmp_path):
    logger = MetricsLogger(RunConfig(logging={"mlflow": {}}), tmp_path)
    with pytest.raises(ConfigError, match=r"logging.mlflow.*pip install 'slurm-align\[mlflow\]'"):
        logger.log({"step": 0, "loss": 1.0})


def test_wandb_config_is_validated():
    with pytest.raises(ValueError, match="mode"):
        RunConfig(logging={"wandb": {"project": "p", "mode": "sometimes"}})
    with pytest.raises(ValueError, match="project"):
        RunConfig(logging={"wandb": {}})


@pytest.mark.mpi
def test_tiny_sft_run_logs_to_tensorboard_and_wandb(tmp_path):
    run_dir = tmp_path / "sft"
    proc = subprocess.run(
        [sys.executable, "-m", "slurm_align.cli", "train", "sft", "examples/sft_tiny.yaml", "--profile", "local",
         "--run-dir", str(run_dir), "--follow", "trainer.num_steps=3", "logging.tensorboard=true",
         "logging.wandb.project=slurm-align-tests", "logging.wandb.mode=offline"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = scalars(run_dir, "loss")
    assert sorted(logged) == [r["step"] for r in records] and len(records) == 3
    for r in records:
        assert logged[r["step"]] == pytest.approx(r["loss"], rel=1e-6)   # TensorBoard stores float32
    assert wandb_run_files(run_dir)


def test_mlflow_run_store_in_the_run_dir(tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    logger = MetricsLogger(RunConfig(logging={"mlflow": {"experiment": "tests"}}), tmp_path)
    for step in range(3):
        logger.log({"step": step, "loss": 1.0 / (step + 1)})
    logger.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(h.step, h.value) for h in history] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
