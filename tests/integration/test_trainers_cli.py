"""`slurm-align train sft|rm|dpo CONFIG --profile NAME` end to end: local profile and a plain
Slurm job on the real test cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def check_run(run_dir: Path, steps: int, algo: str) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert (run_dir / "checkpoints" / algo / f"iter_{steps:07d}" / "manifest.json").is_file()


@pytest.mark.mpi
def test_train_rm_on_local_profile(tmp_path: Path):
    run_dir = tmp_path / "rm"
    proc = cli("train", "rm", "examples/rm_tiny.yaml", "--profile", "local", "--run-dir", str(run_dir),
               "--follow", "trainer.num_steps=3", "trainer.save_interval=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "COMPLETED" in proc.stdout
    check_run(run_dir, 3, "rm")


def test_train_refuses_layout_that_does_not_fit_profile(tmp_path: Path):
    proc = cli("train", "sft", "examples/sft_tiny.yaml", "--profile", "local", "--run-dir", str(tmp_path / "x"),
               "actor.data_parallel=3", timeout=60)
    assert proc.returncode == 2 and "must be equal" in proc.stderr, proc.stderr
    assert not (tmp_path / "x" / "job.json").exists()


@pytest.mark.slurm
def test_train_sft_as_plain_slurm_job(slurm_cluster, tmp_path: Path):
    run_dir = tmp_path / "sft"
    proc = cli("train", "sft", "examples/sft_tiny.yaml", "--profile", "local-slurm", "--run-dir", str(run_dir),
               "--follow", "trainer.num_steps=3", "trainer.save_interval=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_run(run_dir, 3, "sft")
