"""Bootstrap inside a real (local) Slurm cluster: `srun --mpi=pmix` over 2 nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _srun(cluster, mpi: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    # --kill-on-bad-exit, as the job scripts have it: a rank that dies ends the step at once.
    cmd = ["srun", f"--mpi={mpi}", "--kill-on-bad-exit=1", "-N", "2", "-n", "2", "-p", cluster.partition, "--time=5",
           sys.executable, "-W", "ignore", "-m", "tests.programs.slurm_boot_prog"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slurm
def test_bootstrap_under_srun_pmix_two_nodes(slurm_cluster) -> None:
    proc = _srun(slurm_cluster, "pmix")
    assert proc.returncode == 0 and "SLURM_BOOT_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
    assert report["sum"] == 3.0  # 1 + 2: both ranks joined one torch.distributed world
    ranks = report["ranks"]
    assert [r[0] for r in ranks] == [0, 1] and all(r[1] == 2 for r in ranks)
    assert [r[7] for r in ranks] == [0, 1]  # MPI rank == SLURM_PROCID
    assert len({r[6] for r in ranks}) == 2  # two different Slurm nodes


@pytest.mark.slurm
def test_srun_without_pmix_is_a_clear_error(slurm_cluster) -> None:
    proc = _srun(slurm_cluster, "none")
    assert proc.returncode != 0
    assert "--mpi=pmix" in proc.stdout + proc.stderr, proc.stdout + proc.stderr[-4000:]


@pytest.mark.slurm
def test_mpi_world_of_two_ranks_on_each_of_four_nodes(slurm_cluster) -> None:
    """Four slurmd on one host share its /dev/shm: without the cluster's per-node OpenMPI
    segment directory (tests/cluster TASK_PROLOG) every such run segfaulted (15 of 15)."""
    prog = ("from mpi4py import MPI; c = MPI.COMM_WORLD; got = c.allgather(c.Get_rank()); c.Barrier(); "
            "print('RANKS', got) if c.Get_rank() == 0 else None")
    cmd = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", "-N", "4", "-n", "8", "-p", slurm_cluster.partition,
           "--time=5", sys.executable, "-W", "ignore", "-c", prog]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"RANKS {list(range(8))}" in proc.stdout
