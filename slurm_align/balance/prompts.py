"""Work-stealing prompt server: rank 0 hands out batches of prompt indices until none are left.

The server is a thread on the root rank that talks over its OWN duplicate of the communicator,
so its point-to-point traffic can never match a collective the main threads run meanwhile.
The root's own worker takes batches straight from the server's state (same lock, no message).
Each index is handed out exactly once per PromptServer, so an epoch processes the dataset's
multiset exactly, whatever the workers' speeds.

Protocol (int64 buffers, no pickles): request = [batch_size] with tag _REQ; reply = up to
batch_size indices with tag _REPLY; an empty reply means "exhausted". A request for 0 prompts
is a goodbye from a worker that stops early.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from slurm_align.profiling.phases import PROMPT_WAIT


_REQ, _REPLY = 71, 72


class SpanTracer(Protocol):
    def span(self, phase: str, step: int | None) -> Any: ...


class PromptSource(Protocol):
    """What a generation worker iterates: batches of prompt indices (dynamic or static)."""

    wait_times: list[float]

    def batches(self, batch_size: int) -> Iterator[np.ndarray]: ...


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"prompt batch size must be an integer >= 1, got {batch_size!r} (generation.prompt_batch_size)")


class _Timed:
    """Measures the time a worker waits for prompts; reports to a callback and/or tracer."""

    def __init__(self, on_wait: Callable[[float], None] | None, tracer: SpanTracer | None, step: int | None):
        self.on_wait, self.tracer, self.step = on_wait, tracer, step
        self.wait_times: list[float] = []

    def call(self, fn: Callable[[], np.ndarray]) -> np.ndarray:
        t0 = time.perf_counter()
        if self.tracer is not None:
            with self.tracer.span(PROMPT_WAIT, self.step):
                out = fn()
        else:
            out = fn()
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
        from mpi4py import MPI

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
        self._comm = comm.Dup()
        self._root = root
        self._rank = self._comm.Get_rank()
        self._requester = requester
        self._n_requesters = self._comm.allreduce(int(bool(requester)))
        self._timed = _Timed(on_wait, tracer, step)
        self._lock = threading.Lock()
        self._cursor = 0
        self._finished = 0  # requesters told "empty" (or said goodbye)
        self.served_by_source: dict[int, int] = {}  # root only: indices handed to each rank
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if self._rank == root:
            self._thread = threading.Thread(target=self._serve_guarded, name="prompt-server", daemon=True)
            self._thread.start()

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
            self.served_by_source[source] = self.served_by_source.get(source, 0) + len(chunk)
            return chunk

    def _done(self) -> bool:
        with self._lock:
            return self._finished >= self._n_requesters

    def _serve_guarded(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # surfaced by close() on the root
            self._error = exc

    def _serve(self) -> None:
        from mpi4py import MPI

        comm, status = self._comm, MPI.Status()
        req = np.zeros(1, dtype=np.int64)
        idle_since, pause = time.perf_counter(), 0.0
        while not self._done():
            if comm.Iprobe(MPI.ANY_SOURCE, _REQ, status):
                src = status.Get_source()
                comm.Recv([req, MPI.INT64_T], src, _REQ)
                n = int(req[0])
                chunk = self._take(src, n)
                if n > 0:
                    comm.Send([chunk, MPI.INT64_T], src, _REPLY)
                idle_since, pause = time.perf_counter(), 0.0
            elif time.perf_counter() - idle_since > 2e-3:
                # Idle: back off so the thread does not burn the root's core between bursts.
                pause = min(max(pause * 2, 2e-5), 5e-4)
                time.sleep(pause)

    # -- worker side -----------------------------------------------------------------------
    def _request(self, n: int) -> np.ndarray:
        from mpi4py import MPI

        if self._rank == self._root:
            return self._take(self._rank, n).copy()
        self._comm.Send([np.array([n], dtype=np.int64), MPI.INT64_T], self._root, _REQ)
        buf, status = np.empty(n, dtype=np.int64), MPI.Status()
        self._comm.Recv([buf, MPI.INT64_T], self._root, _REPLY, status)
        return buf[: status.Get_count(MPI.INT64_T)]

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        """Yield batches of indices until the server is empty (requesters only, once)."""
        _check_batch_size(batch_size)
        if not self._requester:
            raise RuntimeError("batches() called on a rank built with requester=False")
        got_empty = False
        try:
            while True:
                chunk = self._timed.call(lambda: self._request(int(batch_size)))
                if len(chunk) == 0:
                    got_empty = True
                    return
                yield chunk
        finally:
            if not got_empty:  # stopped early: tell the server so it can finish
                self._say_goodbye()
            self._requester = False

    def _say_goodbye(self) -> None:
        from mpi4py import MPI

        if self._rank == self._root:
            self._take(self._rank, 0)
        else:
            self._comm.Send([np.zeros(1, dtype=np.int64), MPI.INT64_T], self._root, _REQ)

    def close(self) -> None:
        """Collective: wait until every requester has finished, then free the communicator."""
        if self._requester:  # never iterated: still counts as a requester the server waits for
            self._say_goodbye()
            self._requester = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._comm.Barrier()
        self._comm.Free()
        if self._error is not None:
            raise RuntimeError(f"prompt server thread failed: {self._error!r}") from self._error

    def __enter__(self) -> "PromptServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
