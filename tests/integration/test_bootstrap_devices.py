"""Rank -> device placement and the backend choice (parallel/bootstrap.py).

CPU: the choice as a function of what each rank sees. GPU: NCCL all-reduce between 2 ranks
with a GPU each, and the clear refusal when 2 ranks would share the machine's only GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_align.parallel.bootstrap import BootstrapError, Placement, choose_backend

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu(rank: int, host: str, count: int, index: int, uuid: str) -> Placement:
    return Placement(rank, host, count, index, uuid)


def test_cpu_ranks_use_gloo_and_nccl_is_refused():
    cpu = [Placement(0, "a", 0), Placement(1, "a", 0)]
    assert choose_backend(None, cpu) == "gloo"
    with pytest.raises(BootstrapError, match=r"nccl.*gloo"):
        choose_backend("nccl", cpu)
    with pytest.raises(BootstrapError, match="allowed"):
        choose_backend("mpi", cpu)


def test_one_gpu_per_rank_gives_nccl():
    # two nodes, two GPUs each; and Slurm's per-task binding (each task sees one GPU as cuda:0)
    spread = [gpu(r, "ab"[r // 2], 2, r % 2, f"{'ab'[r // 2]}-{r % 2}") for r in range(4)]
    bound = [gpu(r, "a", 1, 0, f"GPU-{r}") for r in range(4)]
    assert choose_backend(None, spread) == choose_backend(None, bound) == "nccl"
    assert choose_backend("gloo", spread) == "gloo"


def test_two_ranks_on_one_gpu_are_refused_with_the_fix():
    shared = [gpu(0, "a", 1, 0, "GPU-x"), gpu(1, "a", 1, 0, "GPU-x")]
    for backend in (None, "nccl"):
        with pytest.raises(BootstrapError, match=r"ranks 0 and 1 on a would share one GPU.*2 ranks.*1 GPU"
                                                 r".*CUDA_VISIBLE_DEVICES="):
            choose_backend(backend, shared)
    assert choose_backend("gloo", shared) == "gloo"  # asked for explicitly: allowed
    with pytest.raises(BootstrapError, match="rank 1 on a sees no GPU"):
        choose_backend(None, [gpu(0, "a", 1, 0, "GPU-x"), Placement(1, "a", 0)])


def _mpirun(n: int, code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, "-W", "ignore", "-c", code]
    return subprocess.run(cmd, cwd=REPO, env={**env, **ENV}, capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for an NCCL all-reduce between 2 ranks; this machine has {GPUS}")
def test_nccl_all_reduce_between_two_ranks():
    code = (
        "import torch, torch.distributed as dist\n"
        "from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed\n"
        "env = init_distributed()\n"
        "assert env.backend == 'nccl' and env.device == f'cuda:{env.local_rank}', env\n"
        "t = torch.full((4,), float(env.rank + 1), device=env.device); dist.all_reduce(t)\n"
        "assert t.tolist() == [3.0] * 4, t\n"
        "shutdown_distributed(env); print('NCCL2_OK', env.rank)\n"
    )
    proc = _mpirun(2, code)
    assert proc.returncode == 0 and proc.stdout.count("NCCL2_OK") == 2, proc.stdout + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(GPUS != 1, reason=f"needs a machine with exactly one GPU; this one has {GPUS}")
def test_two_ranks_on_the_only_gpu_fail_clearly():
    code = (
        "from slurm_align.parallel.bootstrap import BootstrapError, init_distributed\n"
        "try:\n    init_distributed()\nexcept BootstrapError as e:\n    print('REFUSED', e)\n"
    )
    proc = _mpirun(2, code)
    assert proc.returncode == 0 and proc.stdout.count("REFUSED") == 2, proc.stdout + proc.stderr[-4000:]
    assert "share one GPU" in proc.stdout and "CUDA_VISIBLE_DEVICES=" in proc.stdout
