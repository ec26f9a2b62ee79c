"""The layout of a run directory, written down once.

    RUN_DIR/config.yaml            resolved run config
    RUN_DIR/profile.yaml           resolved cluster profile
    RUN_DIR/job.json               submission record (job id, components, script path)
    RUN_DIR/job.sbatch             the rendered script that was submitted
    RUN_DIR/logs/<component>/rank<N>.log
    RUN_DIR/rollouts.zarr          rollout store (PPO)
    RUN_DIR/traces.zarr            per-rank span traces
    RUN_DIR/checkpoints/<name>/iter_<step>
    RUN_DIR/reports/<component>/rank<N>.json   what each rank reports about itself
"""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def profile(self) -> Path:
        return self.root / "profile.yaml"

    @property
    def job_record(self) -> Path:
        return self.root / "job.json"

    @property
    def script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, component: str, rank: int | str) -> Path:
        return self.logs / component / f"rank{rank}.log"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.zarr"

    @property
    def traces(self) -> Path:
        return self.root / "traces.zarr"

    def checkpoints(self, name: str) -> Path:
        return self.root / "checkpoints" / name

    def report(self, component: str, rank: int) -> Path:
        return self.root / "reports" / component / f"rank{rank}.json"

    def is_run_dir(self) -> bool:
        return self.config.is_file()


def new_run_dir(base: str | Path = "runs", name: str = "run") -> Path:
    """A fresh, not yet existing folder under `base`, named by time (no clobbering)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(base)
    for i in range(1000):
        cand = base / f"{name}-{stamp}" if i == 0 else base / f"{name}-{stamp}-{i}"
        if not cand.exists():
            return cand
    raise FileExistsError(f"no free run directory under {base}")


def write_atomic(path: Path, text: str) -> None:
    """Write to a temp file, fsync, then os.replace: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))
