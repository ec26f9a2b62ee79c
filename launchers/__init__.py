"""Entry modules that each rank of a job component runs: `python -m slurm_align.launchers.<name>`.

This folder is installed as the package slurm_align.launchers (a symlink in slurm_align/; slurm_align/resources.py)."""

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import NoReturn


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Import a component's modules with the cyclic garbage collector off, then freeze what they made.

    Importing torch, megatron-core and sympy allocates millions of objects that live as long as the
    process, and every collection meanwhile walks the ones already there: a fifth to a third of a
    rank's import CPU (measured here, `import slurm_align.algorithms.ppo`, mean of six each: 4.18
    CPU-s with the collector on, 3.38 off; with TORCHDYNAMO_DISABLE=1, as the tests run, 3.49 and
    2.24). `gc.freeze()` then moves them out of the collector's sight, so
    the collections of the run itself walk only what the run makes (Python's documented use of it).
    The collector is back on before the component's main runs: a run's own cycles are collected."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def leave(code: int) -> NoReturn:
    """End a component's process with `code` once its main has returned, without Python's teardown.

    A rank holds ~3,000 modules (torch, megatron-core, sympy, ...), and the interpreter's teardown
    clears them one by one and collects their objects: ~1.1 CPU-s a process (measured here:
    importing the actor's modules and exiting, 3.9 CPU-s; 2.8 leaving this way), paid at the end of
    every rank of every run with nothing left to write. What teardown does that matters is done
    first, in its order: the other non-daemon threads joined, the atexit handlers (logging's
    flush, multiprocessing's children, the libraries' own), MPI finalised (mpi4py does it after the
    teardown, which os._exit skips), stdout and stderr flushed. Only on a normal return: an
    exception still takes Python's own way (its traceback, then the teardown)."""
    import atexit
    import contextlib
    import os
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):   # closed, or its reader gone: nothing can reach it
            stream.flush()
    os._exit(code)
