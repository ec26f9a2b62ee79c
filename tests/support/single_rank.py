"""A real MPI and torch.distributed world of ONE rank inside the test process, for unit tests of
code that takes communicators, process groups and a ParallelContext (the rollout collector,
PPOActor.step): the same bootstrap and layout code a job runs (parallel.bootstrap,
parallel.layout) over MPI.COMM_SELF and gloo, with collectives of size 1.

Importing mpi4py calls MPI_Init; without mpirun OpenMPI then starts as a "singleton" and exports
its own PMIx/OMPI variables into the process's C environment (not os.environ). Every process a
later test of the same pytest worker starts (mpirun, srun, a rank program) would inherit them
and take itself for part of this singleton's job, so `mpi()` removes what MPI_Init added.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from typing import Any

from slurm_align.parallel.bootstrap import DistEnv, init_distributed, shutdown_distributed
from slurm_align.parallel.layout import ParallelContext, initialize_model_parallel


def _c_environ() -> dict[bytes, bytes]:
    """The process's C environment (what a child process inherits), which os.environ does not
    see change when a C library calls setenv."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    out, i = {}, 0
    while environ[i] is not None:
        key, _, value = environ[i].partition(b"=")
        out[key] = value
        i += 1
    return out


def mpi() -> Any:
    """mpi4py's MPI module, initialised in this process, with the C environment as it was
    before MPI_Init (variables it added removed, ones it changed restored)."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    before = _c_environ()
    from mpi4py import MPI

    for key, value in _c_environ().items():
        if key not in before:
            os.unsetenv(key)
        elif before[key] != value:
            os.putenv(key, before[key])
    return MPI


@contextlib.contextmanager
def single_rank_world() -> Iterator[tuple[DistEnv, ParallelContext]]:
    """torch.distributed (gloo) and megatron's parallel state over MPI.COMM_SELF, TP = PP = 1;
    torn down on exit (MPI itself stays initialised: it cannot start twice in one process)."""
    env = init_distributed(comm=mpi().COMM_SELF, backend="gloo")
    try:
        pctx = initialize_model_parallel(env, 1, 1)
        try:
            yield env, pctx
        finally:
            pctx.destroy()
    finally:
        shutdown_distributed(env)
