"""Logits/values with TP=2 and PP=2 equal TP=1 with the same weights; full-weight round trip.

Real megatron-core models on real mpirun ranks (tests/programs/models_worker.py is the rank program).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parents[1] / "programs" / "models_worker.py"
ROOT = WORKER.parents[2]   # the repo: tests/programs/x.py -> tests -> repo


def mpirun(n: int, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, str(WORKER), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.mark.mpi
def test_tp2_and_pp2_match_tp1(tmp_path: Path):
    """LM logits and value-model values, each from the same full weights."""
    mpirun(1, "reference", "1", "1", str(tmp_path))
    for tp, pp in [(2, 1), (1, 2)]:
        mpirun(2, "check", str(tp), str(pp), str(tmp_path))
        for kind in ("lm", "value"):
            for rank in range(2):
                path = tmp_path / f"check_{kind}{rank}.txt"
                text = path.read_text()
                out_err = float(re.search(r"out_err=(\S+)", text).group(1))
                weight_err = float(re.search(r"weight_err=(\S+)", text).group(1))
                init_err = float(re.search(r"init_err=(\S+)", text).group(1))
                assert out_err <= 1e-5, f"{kind} TP={tp} PP={pp} rank {rank}: {text}"
                assert weight_err == 0.0, f"{kind} full_state_dict round trip TP={tp} PP={pp}: {text}"
                assert init_err == 0.0, f"{kind}: same seed, different weights under TP={tp} PP={pp}: {text}"
                path.unlink()
