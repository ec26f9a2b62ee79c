"""init_distributed / shutdown_distributed in the test process (a world of one rank over
MPI.COMM_SELF): what a bootstrap leaves behind in a process that goes on after it."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
from tests.support.single_rank import mpi


def test_shutdown_leaves_the_processes_other_files_open(tmp_path: Path) -> None:
    """Rank 0 hands its rendezvous socket to the TCPStore, which closes that fd when it goes:
    nothing else may close it too, or the store later closes whatever file took the number."""
    env = init_distributed(comm=mpi().COMM_SELF, backend="gloo")
    shutdown_distributed(env)
    # The lowest free numbers: a socket closed twice would hand its number to one of these.
    fds = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_RDWR) for i in range(4)]
    del env
    gc.collect()   # the store goes
    closed = []
    for fd in fds:
        try:
            os.close(fd)
        except OSError:   # EBADF: someone closed it under us
            closed.append(fd)
    assert not closed, f"file descriptors {closed} were closed by the torch.distributed teardown"
