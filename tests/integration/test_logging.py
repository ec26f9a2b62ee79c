"""Metrics to TensorBoard and W&B (offline) besides metrics.jsonl: read back from the files the
libraries wrote, after a real tiny training run and across a resume."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig
from slurm_align.profiling.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parents[2]
LOGGING = {"tensorboard": True, "wandb": {"project": "slurm-align-tests", "mode": "offline"}}


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def wandb_run_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_records(path: Path) -> list:
    """The protobuf Records of an offline W&B run file: a 7-byte header (':W&B', magic, version),
    then LevelDB-log chunks in 32 KiB blocks (crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if left < 7 or (length == 0 and kind == 0):   # block trailer / padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):   # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(path: Path) -> tuple[str, dict[int, dict]]:
    """(run id, {step: logged scalars}) of one offline W&B run file."""
    records = wandb_records(path)
    (run_id,) = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            items = {k: v for k, v in items.items() if not k.startswith("_")}   # W&B's own _step, _runtime
            history[int(r.history.step.num)] = items
    return run_id, history


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
    # W&B: the resumed job continues the same run (same id) and logs only the redone steps, with
    # their new values; NaN is not sent. (W&B's service writes the file in the background; a job
    # flushes it on exit, as teardown does here.)
    wandb.teardown()
    first_file, again_file = wandb_run_files(tmp_path)
    (id1, h1), (id2, h2) = wandb_history(first_file), wandb_history(again_file)
    assert id1 == id2 == tmp_path.name
    assert h1 == {0: {"loss": 10.0}, 1: {"loss": 11.0}, 2: {"loss": 12.0}, 3: {"loss": 13.0}}
    assert h2 == {2: {"loss": 22.0}, 3: {"loss": 23.0}}


def test_only_the_logging_rank_writes(tmp_path):
    quiet = MetricsLogger(RunConfig(logging=LOGGING), tmp_path, enabled=False)
    quiet.start_at(0)
    quiet.log({"step": 0, "loss": 1.0})
    quiet.close()
    assert list(tmp_path.iterdir()) == []


def test_missing_tracking_library_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)   # as if not installed: `import mlflow` fails
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
    (_, history), = (wandb_history(p) for p in wandb_run_files(run_dir))
    assert {step: h["loss"] for step, h in history.items()} == pytest.approx({r["step"]: r["loss"] for r in records})


def test_mlflow_run_store_in_the_run_dir(tmp_path):
    # mlflow-skinny is in the test extra: this runs in CI (a missing mlflow fails at import above).
    logger = MetricsLogger(RunConfig(logging={"mlflow": {"experiment": "tests"}}), tmp_path)
    for step in range(3):
        logger.log({"step": step, "loss": 1.0 / (step + 1)})
    logger.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(h.step, h.value) for h in history] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
