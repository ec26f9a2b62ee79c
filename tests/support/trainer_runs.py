"""Helpers for the trainer tests: write a run dir from an example config + overrides and run
launchers/train.py on real mpirun ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from slurm_align.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]


def make_run(run_dir: Path, example: str, overrides: list[str]) -> Path:
    run = load_run_config(ROOT / "examples" / example, overrides)
    data = run.model_dump(mode="json")
    for key in ("train_path", "val_path"):
        if data["data"][key]:
            data["data"][key] = str(ROOT / data["data"][key])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    return run_dir


def train(run_dir: Path, ranks: int = 1, timeout: int = 300) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-n", str(ranks), sys.executable,
           str(ROOT / "launchers" / "train.py"), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return metrics(run_dir)


def metrics(run_dir: Path) -> list[dict]:
    """Per-step records; a step logged twice (before and after a resume) keeps the last."""
    by_step = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]
