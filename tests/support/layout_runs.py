"""The tensor/pipeline-parallel layout runs that tests/integration/test_models_parallel.py and
test_checkpoint.py assert on, launched once per session (the `layout_runs` fixture in conftest).

Four launches of tests/programs/models_worker.py where the two files made eight: a rank's start-up
(torch and megatron imports, the gloo world) is most of each launch's cost, so every layout runs
all its checks in one launch:
1. 1 rank, TP=1 PP=1: the reference weights and outputs (LM and value model), into every layout's folder;
2. 2 ranks per layout (TP=2 PP=1, TP=1 PP=2): its outputs against the reference and the full-weight
   round trip (`check`), then a sharded checkpoint with AdamW state (`ckpt_save`);
3. 1 rank, TP=1: loads each layout's checkpoint, and a copy of the TP=2 one with a shard cut in
   half, which the load must refuse (its CheckpointError is written where the test reads it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).parents[1] / "programs" / "models_worker.py"
ROOT = WORKER.parents[2]   # the repo: tests/programs/x.py -> tests -> repo
LAYOUTS = ((2, 1), (1, 2))
"""(TP, PP) of the 2-rank layouts."""


def mpirun(n: int, *args: str, timeout: int = 120, program: Path = WORKER) -> subprocess.CompletedProcess:
    """`n` real MPI ranks of a test program (default models_worker.py) from the repo root."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, str(program), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@dataclass(frozen=True)
class LayoutRuns:
    root: Path
    damaged_shard: str
    """File name of the shard cut in half in `damaged` (a copy of the TP=2 layout's folder)."""

    def folder(self, tp: int, pp: int) -> Path:
        """check_{lm,value}{rank}.txt, ckpt/, load0.txt of the layout."""
        return self.root / f"tp{tp}_pp{pp}"

    @property
    def damaged(self) -> Path:
        return self.root / "damaged"


def run_layouts(root: Path) -> LayoutRuns:
    from slurm_align.models.checkpoint import find_latest

    folders = [root / f"tp{tp}_pp{pp}" for tp, pp in LAYOUTS]
    for folder in folders:
        folder.mkdir(parents=True)
    mpirun(1, "reference", "1", "1", *map(str, folders))
    for (tp, pp), folder in zip(LAYOUTS, folders):
        mpirun(2, "check+ckpt_save", str(tp), str(pp), str(folder), timeout=180)
    damaged = root / "damaged"
    shutil.copytree(root / "tp2_pp1", damaged)
    ckpt = find_latest(damaged / "ckpt")
    assert ckpt is not None, f"no checkpoint in {damaged / 'ckpt'}"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    mpirun(1, "ckpt_load", "1", "1", *map(str, folders), str(damaged))
    return LayoutRuns(root, shard.name)
