"""Waiting on the ranks of a component without spinning a core.

A blocking MPI call busy-polls for as long as it waits (measured: a rank held 4 s at a barrier
uses 4 s of CPU). Where a rank may wait long (the actor's ranks while rank 0 receives a step's
samples from the generator; the generator's ranks while rank 0 receives weights; the prompt
server's thread on rank 0 for a whole generation phase), that spin takes a core from the ranks
doing the work on a shared node. These waits poll a non-blocking request at a short interval
instead (as the critic's followers do: critic/channel.py).

A blocking collective that the ranks reach at different times spins the same way in the early
ones (the step's first collective, the prompt server's; the rebalance after generation and after
the log-probs; evaluation's reductions; the preemption vote; a worker waiting for its next
prompts): each is preceded by `barrier` (or waits on its request with `wait`), so the collective
itself starts with every rank there. Where ranks share cores this decides the step time: the
spinning ranks take the core the slow one needs. Measured on the local Slurm cluster (4 actor
"nodes" on this 2-core host, benchmarks/bench_plan.py): GRPO's step 0.63-0.93 s -> 0.15-0.36 s
over five runs (each rank's CPU 6-14 CPU-s -> 5.5), PPO's 1.3 s -> 0.40-0.71 s. A hot window
before the first sleep (polling without sleeping for 1 ms, as `message` does) made those runs
slower again (0.50 and 0.78 s): with more ranks than cores, even a millisecond's spin per wait
costs the rank that is still working.
"""

from __future__ import annotations

import time

POLL_S = 0.001
HOT_S = 0.001        # `message`: how long it polls without sleeping for the next message
MAX_SLEEP_S = 0.005  # `message`: its longest sleep between polls when idle


def wait(request, poll_s: float = POLL_S, status=None) -> None:
    """Wait for an MPI request (Ibarrier, Ibcast, Irecv...) by polling it, sleeping between
    polls; `status` (an MPI.Status) is filled as Request.Wait would."""
    while not request.Test(status):
        time.sleep(poll_s)


def barrier(comm, poll_s: float = POLL_S) -> None:
    """comm.Barrier() without the spin (a no-op on one rank)."""
    if comm.Get_size() > 1:
        wait(comm.Ibarrier(), poll_s)


def message(comm, source: int, tag: int, status=None, hot_s: float = HOT_S, max_sleep_s: float = MAX_SLEEP_S):
    """Wait for a message from `source` with `tag` and return it matched (MPI_Improbe: only the
    caller can receive it, with `msg.Recv(buf)`, whatever other threads probe meanwhile).

    For `hot_s` after the call it polls without sleeping, so a server answering a stream of
    requests takes the next one at once; then it sleeps between polls, twice as long each time
    up to `max_sleep_s`, so a long idle wait costs a few hundred wake-ups a second instead of a
    core, and the first message after it waits at most `max_sleep_s`."""
    hot_until, sleep_s = time.perf_counter() + hot_s, POLL_S / 8
    while (msg := comm.Improbe(source, tag, status)) is None:
        if time.perf_counter() > hot_until:
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, max_sleep_s)
    return msg
