"""Bootstrap and parallel layout on real MPI ranks (gloo), and bootstrap's error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(cmd, cwd=REPO, env={**env, **ENV}, capture_output=True, text=True, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.slow  # 4 ranks importing megatron-core on 2 cores: 40-80 s
def test_layout_and_refold_on_four_ranks() -> None:
    """(TP,PP,DP) in (1,1,4), (1,2,2), (2,2,1): megatron's ranks, refold mapping, groups, prompts."""
    cmd = ["mpirun", "--oversubscribe", "-n", "4", sys.executable, "-W", "ignore", "-m", "tests.programs.layout_prog"]
    proc = _run(cmd, timeout=300)
    assert proc.returncode == 0 and "LAYOUT_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
    assert [r[:3] for r in report["ranks"]] == [[r, r, 4] for r in range(4)]  # one node: local == global
    # dp_gen = dp_rank + dp_size*pp_rank, with rank = tp_rank + tp*(dp_rank + dp*pp_rank)
    for cfg in report["configs"]:
        tp, dp = cfg["tp"], cfg["dp"]
        want = [(r // tp) % dp + dp * (r // (tp * dp)) for r in range(4)]
        assert cfg["dp_gen_by_rank"] == want, cfg
    assert [(c["tp"], c["pp"], c["dp"]) for c in report["configs"]] == [(1, 1, 4), (1, 2, 2), (2, 2, 1)]


def test_bootstrap_errors_are_clear() -> None:
    proc = _run([sys.executable, "-W", "ignore", "-m", "tests.programs.bootstrap_errors_prog"], timeout=120)
    assert proc.returncode == 0 and "BOOTSTRAP_ERRORS_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    for name in ("no_mpi", "size_mismatch", "nccl_without_gpu", "bad_port", "port_in_use", "twice"):
        assert f"\n{name}: " in "\n" + proc.stdout, name


def test_layout_validation_names_fields() -> None:
    from slurm_align.config.errors import ConfigError
    from slurm_align.parallel.layout import expected_ranks, validate_layout

    assert validate_layout(8, 2, 2) == 2
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel.*6.*world size 4"):
        validate_layout(4, 3, 2)
    with pytest.raises(ConfigError, match=r"parallel\.pipeline_parallel"):
        validate_layout(4, 1, 0)
    r = expected_ranks(5, tp=2, pp=2, world=8)  # 5 = 1 + 2*(0 + 2*1)
    assert (r.tp_rank, r.dp_rank, r.pp_rank, r.dp_size) == (1, 0, 1, 2)


@pytest.mark.gpu
@pytest.mark.mpi  # init_distributed calls MPI_Init: deselected where there is no MPI launcher
def test_bootstrap_picks_nccl_on_gpu() -> None:
    """On a GPU machine the default backend is NCCL and collectives run on the rank's device."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed\n"
        "env = init_distributed()\n"
        "assert env.backend == 'nccl' and env.device == 'cuda:0', env\n"
        "t = torch.ones(4, device=env.device); dist.all_reduce(t)\n"
        "assert t.sum().item() == 4.0\n"
        "shutdown_distributed(env); print('NCCL_OK')\n"
    )
    proc = _run([sys.executable, "-W", "ignore", "-c", code], timeout=180)
    assert proc.returncode == 0 and "NCCL_OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
