"""Per-step metrics: RUN_DIR/metrics.jsonl always, plus TensorBoard, W&B and MLflow when the run
config's `logging` section asks for them (slurm_align.config.run.LoggingConfig).

    metrics = MetricsLogger(run, run_dir, enabled=rank == 0)
    metrics.start_at(first_step)     # a resumed run redoes the steps from here: their records go
    metrics.log({"step": s, ...})    # one record per step; numbers go to every backend
    metrics.close()

Only one rank logs (the others hold a disabled logger). The backends are opened at the first
record, so that a resume (start_at) is known by then: TensorBoard purges the redone steps' events.
The tracking libraries are optional extras (`pip install 'slurm-align[tensorboard]'`, `[wandb]`,
`[mlflow]`) and are imported when a run asks for them. Secrets are never in the config: W&B reads
WANDB_API_KEY from the job's environment (a profile's `secret_env`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Protocol

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import LoggingConfig, RunConfig
from slurm_align.rundir import write_atomic

METRICS_FILE = "metrics.jsonl"


class Backend(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _require(module: str, field: str, extra: str):
    try:
        return __import__(module, fromlist=["_"])
    except ModuleNotFoundError:
        raise ConfigError.at(field, "set", f"needs the '{module.split('.')[0]}' package in the job's Python: "
                                           f"pip install 'slurm-align[{extra}]'") from None


class TensorBoardBackend:
    """Event files in RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    def __init__(self, log_dir: Path, purge_step: int | None):
        _require("tensorboard", "logging.tensorboard", "tensorboard")
        # torch's writer; tensorboard itself only reads. Deferred: an optional extra.
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()   # a killed job keeps what it logged

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run under RUN_DIR/wandb/; mode 'offline' writes there only (`wandb sync` uploads later).
    One W&B run per run directory: a resumed job continues it (its id derives from the folder)."""

    def __init__(self, cfg, run: RunConfig, run_dir: Path):
        wandb = _require("wandb", "logging.wandb", "wandb")
        run_id = cfg.id or re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:64]
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or run_dir.name, id=run_id,
                              group=cfg.group, tags=cfg.tags or None, mode=cfg.mode, dir=str(run_dir),
                              config=run.model_dump(mode="json"), resume="allow",
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    """An MLflow run; default tracking store: RUN_DIR/mlruns (a file store, no server)."""

    def __init__(self, cfg, run: RunConfig, run_dir: Path):
        self.mlflow = _require("mlflow", "logging.mlflow", "mlflow")
        if cfg.tracking_uri is None:
            # MLflow 3 refuses its file store unless this is set; the run's own store needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow.set_tracking_uri(cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(cfg.experiment)
        self.mlflow.start_run(run_name=cfg.run_name or run_dir.name)
        self.mlflow.log_params({"algorithm": run.algorithm, "seed": run.seed})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class MetricsLogger:
    """One run's per-step records: metrics.jsonl and the backends the run config names."""

    def __init__(self, run: RunConfig, run_dir: str | Path, *, enabled: bool = True):
        self.run, self.run_dir, self.enabled = run, Path(run_dir), enabled
        self.path = self.run_dir / METRICS_FILE
        self.cfg: LoggingConfig = run.logging
        self._backends: list[Backend] | None = None
        self._purge_step: int | None = None

    def start_at(self, step: int) -> None:
        """The run (re)starts at `step`: records of steps >= step, left by an earlier job, go."""
        if not self.enabled:
            return
        self._purge_step = step
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line)["step"] < step]
            write_atomic(self.path, "".join(f"{line}\n" for line in kept))

    def _open(self) -> list[Backend]:
        backends: list[Backend] = []
        if self.cfg.tensorboard:
            backends.append(TensorBoardBackend(self.run_dir / "tensorboard", self._purge_step))
        if self.cfg.wandb is not None:
            backends.append(WandbBackend(self.cfg.wandb, self.run, self.run_dir))
        if self.cfg.mlflow is not None:
            backends.append(MlflowBackend(self.cfg.mlflow, self.run, self.run_dir))
        return backends

    def log(self, record: dict[str, Any]) -> None:
        """Append one step's record (it must hold "step"); its finite numbers go to the backends."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._backends is None:
            self._backends = self._open()
        scalars = {k: float(v) for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        for backend in self._backends:
            backend.log(int(record["step"]), scalars)

    def close(self) -> None:
        for backend in self._backends or []:
            backend.close()
        self._backends = []
