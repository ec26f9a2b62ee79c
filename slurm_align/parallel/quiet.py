"""Waiting on the ranks of a component without spinning a core.

A blocking MPI call busy-polls for as long as it waits (measured: a rank held 4 s at a barrier
uses 4 s of CPU). Where a rank may wait long (the actor's ranks while rank 0 receives a step's
samples from the generator; the generator's ranks while rank 0 receives weights), that spin
takes a core from the ranks doing the work on a shared node. These waits poll a non-blocking
request at a short interval instead (as the critic's followers do: critic/channel.py).
"""

from __future__ import annotations

import time

POLL_S = 0.001


def wait(request, poll_s: float = POLL_S) -> None:
    """Wait for an MPI request (Ibarrier, Ibcast...) by polling it, sleeping between polls."""
    while not request.Test():
        time.sleep(poll_s)


def barrier(comm, poll_s: float = POLL_S) -> None:
    """comm.Barrier() without the spin (a no-op on one rank)."""
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), poll_s)
