"""Work-stealing prompt server: rank 0 hands out batches of prompt indices until none are left.

The server is a thread on the root rank that talks over its OWN duplicate of the communicator,
so its point-to-point traffic can never match a collective the main threads run meanwhile.
The root's own worker takes batches straight from the server's state (same lock, no message).
The thread waits for requests asleep between polls (parallel/quiet.message), not in a blocking
receive, which would busy-poll a core beside the root's own generation for the whole phase.
Each index is handed out exactly once per PromptServer, so an epoch processes the dataset's
multiset exactly, whatever the workers' speeds.

Protocol (int64 buffers, no pickles): request = [batch_size] with tag _REQ; reply = up to
batch_size indices with tag _REPLY; an empty reply means "exhausted". A request for 0 prompts
is a goodbye from a worker that stops early.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from slurm_align.parallel import quiet
from slurm_align.profiling.phases import PROMPT_WAIT

_REQ, _REPLY = 71, 72


class SpanTracer(Protocol):
    def span(self, phase: str, step: int | None) -> Any: ...


class PromptSource(Protocol):
    """What a generation worker iterates: batches of prompt indices (dynamic or static)."""

    @property
    def wait_times(self) -> list[float]: ...

    def batches(self, batch_size: int) -> Iterator[np.ndarray]: ...

    def close(self) -> None: ...


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            f"prompt batch size must be an integer >= 1, got {batch_size!r} (generation.prompt_batch_size)")


class _Timed:
    """Measures the time a worker waits for prompts; reports to a callback and/or tracer."""

    def __init__(self, on_wait: Callable[[float], None] | None, tracer: SpanTracer | None, step: int | None):
        self.on_wait, self.tracer, self.step = on_wait, tracer, step
        self.wait_times: list[float] = []

    def call(self, fn: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        t0 = time.perf_counter()
        if self.tracer is None:
            out = fn(*args)
        else:
            with self.tracer.span(PROMPT_WAIT, self.step):
                out = fn(*args)
        dt = time.perf_counter() - t0
        self.wait_times.append(dt)
        if self.on_wait is not None:
            self.on_wait(dt)
        return out


class PromptServer:
    """Dynamic prompt distribution over `comm`. Constructing and close() are collective.

    `requester`: whether this rank will call batches() (one rank per generation replica).
    `order`: the indices to hand out (e.g. a seeded per-epoch shuffle); default range(num_prompts).
    """

    def __init__(
        self,
        comm: Any,
        num_prompts: int | None = None,
        *,
        requester: bool = True,
        order: np.ndarray | None = None,
        root: int = 0,
        on_wait: Callable[[float], None] | None = None,
        tracer: SpanTracer | None = None,
        step: int | None = None,
    ):
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "the prompt server needs MPI_THREAD_MULTIPLE (a server thread beside the main "
                "thread); this MPI was initialised with less: do not set mpi4py.rc.threads=False"
            )
        if order is None:
            if num_prompts is None or num_prompts < 0:
                raise ValueError(f"PromptServer needs num_prompts >= 0 or an order array, got {num_prompts!r}")
            order = np.arange(num_prompts, dtype=np.int64)
        self._order = np.ascontiguousarray(order, dtype=np.int64)
        quiet.barrier(comm)   # the step's first collective: ranks come from the last step at different times
        self._comm = comm.Dup()
        self._root = root
        self._rank = self._comm.Get_rank()
        self._requester = requester
        self._n_requesters = self._comm.allreduce(int(bool(requester)))
        self._timed = _Timed(on_wait, tracer, 0 if step is None else step)
        self._lock = threading.Lock()
        self._cursor = 0
        self._finished = 0  # requesters told "empty" (or said goodbye)
        self._buf: np.ndarray | None = None  # worker's reusable reply buffer (no prefetch)
        # the request, status and reply specs of mpi4py (imported when first used: it calls MPI_Init)
        self._msg: Any = None
        self._status: Any = None
        self._buf_spec: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if self._rank == root:
            self._thread = threading.Thread(target=self._serve_guarded, name="prompt-server", daemon=True)
            self._thread.start()

    @property
    def remaining(self) -> int:
        """Root only: prompts not handed out yet (0 once every one has gone to a worker)."""
        if self._rank != self._root:
            raise RuntimeError(f"PromptServer.remaining is known on the root (rank {self._root}) only, "
                               f"not on rank {self._rank}")
        return len(self._order) - self._cursor   # an int read: atomic, no lock needed

    @property
    def wait_times(self) -> list[float]:
        """Seconds this worker waited for each batch (phase prompt_wait)."""
        return self._timed.wait_times

    # -- server side (root) --------------------------------------------------------------
    def _take(self, source: int, n: int) -> np.ndarray:
        with self._lock:
            if n == 0:  # goodbye
                self._finished += 1
                return self._order[:0]
            chunk = self._order[self._cursor : self._cursor + n]
            self._cursor += len(chunk)
            if len(chunk) == 0:
                self._finished += 1
            return chunk

    def _done(self) -> bool:
        return self._finished >= self._n_requesters  # an int read: atomic, no lock needed

    def _serve_guarded(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            # Every worker waits for this thread's replies and would wait forever: take the
            # whole component down (the job script then stops the other components).
            self._error = exc
            traceback.print_exc()
            sys.stderr.flush()
            self._comm.Abort(1)

    def _serve(self) -> None:
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        # Hot loop: everything looked up once (Python overhead is most of a request's cost).
        comm, status, lock, order = self._comm, MPI.Status(), self._lock, self._order
        send, source, any_src = comm.Send, status.Get_source, MPI.ANY_SOURCE
        req = np.zeros(1, dtype=np.int64)
        req_spec, int64 = [req, MPI.INT64_T], MPI.INT64_T
        while self._finished < self._n_requesters:
            # asleep between requests (module docstring; its cost: tests/integration/test_balance.py)
            quiet.message(comm, any_src, _REQ, status).Recv(req_spec)
            n = int(req[0])
            if n > 0:
                with lock:
                    start = self._cursor
                    self._cursor = stop = min(start + n, len(order))
                    if stop == start:
                        self._finished += 1
                send([order[start:stop], int64], source(), _REPLY)
            elif n == 0:  # goodbye
                with lock:
                    self._finished += 1
            # n < 0: wake-up from the root's own worker, only to re-check the loop condition.

    def _wake_if_done(self) -> None:
        """The root's worker finished last: the server thread still waits in Recv; wake it."""
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if self._done():
            self._comm.Send([np.full(1, -1, dtype=np.int64), MPI.INT64_T], self._root, _REQ)

    # -- worker side -----------------------------------------------------------------------
    def _post(self, n: int) -> tuple:
        """Send a request for n prompts; returns the pending reply (root: already answered)."""
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if self._rank == self._root:
            chunk = self._take(self._rank, n).copy()
            if len(chunk) == 0:
                self._wake_if_done()
            return (chunk,)
        msg = np.array([n], dtype=np.int64)
        buf = np.empty(n, dtype=np.int64)
        sreq = self._comm.Isend([msg, MPI.INT64_T], self._root, _REQ)
        rreq = self._comm.Irecv([buf, MPI.INT64_T], self._root, _REPLY)
        return (None, msg, buf, sreq, rreq)

    def _request(self, n: int) -> np.ndarray:
        """One blocking round trip (no prefetch); buffers reused, the reply copied out."""
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if self._rank == self._root:
            return self._post(n)[0]
        if self._buf is None or len(self._buf) != n:
            # Buffer specs built once: mpi4py parses [array, datatype] cheaper than a bare array.
            self._buf, self._status = np.empty(n, dtype=np.int64), MPI.Status()
            self._msg = [np.array([n], dtype=np.int64), MPI.INT64_T]
            self._buf_spec = [self._buf, MPI.INT64_T]
        self._comm.Send(self._msg, self._root, _REQ)
        # asleep while the root answers (a blocking Recv spins: a core the root may need)
        quiet.wait(self._comm.Irecv(self._buf_spec, self._root, _REPLY), status=self._status)
        return self._buf[: self._status.Get_count(MPI.INT64_T)].copy()

    def _wait(self, pending: tuple | int) -> np.ndarray:
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if isinstance(pending, int):  # no prefetch: one blocking round trip
            return self._request(pending)
        if pending[0] is not None:
            return pending[0]
        _, _msg, buf, sreq, rreq = pending
        status = MPI.Status()
        quiet.wait(rreq, status=status)   # asleep: a blocking Wait spins a core the root may need
        sreq.Wait()
        return buf[: status.Get_count(MPI.INT64_T)]

    def batches(self, batch_size: int, *, prefetch: bool = True) -> Iterator[np.ndarray]:
        """Yield batches of indices until the server is empty (requesters only, once).

        prefetch: keep one request in flight while the caller works on the current batch, so
        the round trip hides behind the work (at most one extra batch held per worker).
        On the root the iteration ends only once every worker has drained the server.
        """
        _check_batch_size(batch_size)
        if not self._requester:
            raise RuntimeError("batches() called on a rank built with requester=False")
        n = int(batch_size)
        prefetch = prefetch and self._rank != self._root  # the root's own takes cost no round trip
        # `pending` is a request in flight (prefetch) or just the size of the next request.
        pending: tuple | int | None = self._post(n) if prefetch else n
        exhausted = False
        timed, wait = self._timed, self._wait
        try:
            while True:
                chunk = timed.call(wait, pending)
                pending = None
                if len(chunk) == 0:
                    exhausted = True
                    self._join_server()
                    return
                if prefetch:
                    pending = self._post(n)
                yield chunk
                if pending is None:
                    pending = n
        finally:
            # Stopped early: drain the reply in flight; unless it was the "empty", say goodbye
            # so the server does not wait for this worker.
            if isinstance(pending, int):
                pending = None  # nothing in flight
            if not exhausted and (pending is None or len(self._wait(pending)) > 0):
                self._say_goodbye()
            self._requester = False

    def _join_server(self) -> None:
        """Root: wait (asleep, not in MPI) until every worker has drained the server.

        Otherwise the root's main thread would go on into MPI collectives that spin beside the
        server thread, and OpenMPI's progress lock makes the two starve each other.
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _say_goodbye(self) -> None:
        from mpi4py import MPI  # deferred: importing mpi4py calls MPI_Init

        if self._rank == self._root:
            self._take(self._rank, 0)
            self._wake_if_done()
        else:
            self._comm.Send([np.zeros(1, dtype=np.int64), MPI.INT64_T], self._root, _REQ)

    def close(self) -> None:
        """Collective: wait until every requester has finished, then free the communicator.

        A requester that dies takes the component down through the MPI runtime (srun
        --kill-on-bad-exit, mpirun), and a failing server thread aborts it: no wait here is
        left hanging on a rank that is gone."""
        if self._requester:  # never iterated: still counts as a requester the server waits for
            self._say_goodbye()
            self._requester = False
        self._join_server()
        quiet.barrier(self._comm)   # ranks that ran out of work wait here for the slowest, asleep
        self._comm.Free()
        if self._error is not None:
            raise RuntimeError(f"prompt server thread failed: {self._error!r}") from self._error

    def __enter__(self) -> PromptServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
