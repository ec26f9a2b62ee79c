"""The actor's side of the critic: futures over HTTP (KServe v2, binary tensors).

- `CriticClient.for_run_dir(run_dir)` (or `from_run_config`): the run's secret and the address the
  critic published in the run directory (it picks a free port at start). `infer_async` /
  `train_async` return Futures at once, so the actor keeps computing while the critic works;
  each Future carries its own request's answer. Every request carries the run's secret.
- The first request waits for the critic to publish its address and come up, retrying with
  exponential backoff up to `connect_timeout_s` (no fixed sleep). Afterwards every request is
  bounded by `request_timeout_s`: a dead or hung critic raises CriticError naming host, port
  and endpoint.
- A request the server dropped is sent again once the critic answers again: its watchdog
  starts a new tritonserver (server.py), withdrawing its published address meanwhile, when
  tritonserver died (connection closed or refused) or when asked to (this client asks when
  tritonserver answers that a model's stub is unhealthy: its answers are broken from then on).
  Nothing says it comes back within `restart_notice_s`: the request fails as before. A
  timeout is never retried (a hung critic), nor is critic_shutdown; critic_train carries a
  request_id, so a retried step is not applied twice.
- Every request carries a request_id that its reply echoes (protocol.py): a reply with another
  id (the late answer of a request that timed out, delivered in place of this one's) or without
  the outputs asked for (a broken stub's) is never returned; the connection is dropped and the
  request sent again, as one the server dropped (without outputs: after a restart).
- Only the model-parallel source rank of the actor should call the critic; `share_from_source`
  hands its result to the other ranks of the model-parallel group.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from slurm_align.critic import protocol as P
from slurm_align.rundir import RunDir, address_problem, read_run_secret


class CriticError(RuntimeError):
    """A critic request failed: the message names host, port and endpoint, and why."""


class CriticUnavailableError(CriticError):
    """The critic did not become ready within connect_timeout_s."""


class _ServerLost(CriticError):
    """The server dropped the request (not a timeout): worth sending again once it is back."""


class _ServerBroken(_ServerLost):
    """tritonserver answered that a stub is unhealthy: it must be restarted before a retry."""


RETRIES = 2   # sends of a request after the first, each after the critic answered again


def _server_lost(exc: Exception) -> bool:
    """Whether a failed request was dropped by a dying or restarted tritonserver."""
    if isinstance(exc, ConnectionError):   # refused, reset, broken pipe
        return True
    return type(exc).__name__ == "HTTPConnectionClosed"   # geventhttpclient: closed mid-answer


def _server_reason(text: str) -> str:
    """The useful sentence of a server error: our payload or refusal message when there is one
    (PyTriton forwards the whole traceback), else the server's own text."""
    m = re.search(r"CriticPayloadError: ([^\n\\]+)", text)
    if m:
        return f"rejected payload: {m.group(1).strip()}"
    m = re.search(r"CriticAuthError: ([^\n\\]+)", text)
    if m:
        return m.group(1).strip()
    if "restricted, expecting header" in text:
        return "refused: the critic does not know this run's secret (another run's critic?)"
    return text.strip()


class CriticClient:
    """Futures-based client of the critic server at `host:port`, or at the address its run's
    critic publishes (`run_dir`); every request carries `secret`. `component`: the serving
    component whose address it reads (another kind served by the critic's server, e.g. the
    teacher, is reached by this client too)."""

    def __init__(self, host: str | None, port: int | None, *, secret: str, run_dir: str | Path | None = None,
                 connect_timeout_s: float = 120.0, request_timeout_s: float = 300.0, max_in_flight: int = 64,
                 restart_notice_s: float = 5.0, component: str = "critic"):
        if (host is None or port is None) and run_dir is None:
            raise ValueError("CriticClient needs host and port, or the run_dir its critic publishes them in")
        self.component = component
        self.run_dir = None if run_dir is None else RunDir(Path(run_dir))
        # With run_dir the address is the published one (`host` replaces its host when given).
        self.host, self.port = (None, None) if self.run_dir else (host, port)
        self._host_override = host if self.run_dir else None
        self._secret = secret
        self._headers = P.auth_headers(secret)
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.restart_notice_s = restart_notice_s
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="critic-client")
        self._local = threading.local()
        self._ready = threading.Event()
        self._connect_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._recovered_at = self._gave_up_at = -float("inf")   # time.monotonic() of the last verdicts

    @classmethod
    def for_run_dir(cls, run_dir: str | Path, host: str | None = None, **kw) -> CriticClient:
        """The client of the run's own critic: its secret, the address it publishes at start."""
        rd = RunDir(Path(run_dir))
        return cls(host, None, secret=read_run_secret(rd), run_dir=rd.root, **kw)

    @classmethod
    def from_run_config(cls, run, host: str | None = None) -> CriticClient:
        """The run's critic (run.run_dir), timeouts from run.critic_server; `host` replaces the
        published host (another address of the critic's node)."""
        cs = run.critic_server
        return cls.for_run_dir(run.run_dir, host, connect_timeout_s=cs.connect_timeout_s,
                               request_timeout_s=cs.request_timeout_s)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _where(self, endpoint: str) -> str:
        if self.host is None:
            return f"{self.component} of {self.run_dir.root} (address not published yet), endpoint {endpoint}"
        return f"{self.component} at {self.host}:{self.port}, endpoint {endpoint}"

    # -- connection ------------------------------------------------------------------------
    def _locate(self) -> str | None:
        """Take the address the critic published; None while it has published none. A file
        from an earlier job (another secret) does not count."""
        found, why = address_problem(self.run_dir, self.component, self._secret)
        if found is None:
            return why
        host, port = found
        self.host, self.port = self._host_override or host, port
        return None

    def connect(self, timeout_s: float | None = None) -> None:
        """Wait until every endpoint is ready, retrying with backoff up to `timeout_s`
        (connect_timeout_s by default)."""
        if self._ready.is_set():
            return
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        with self._connect_lock:
            if self._ready.is_set():
                return
            deadline = time.monotonic() + timeout_s
            delay, last = 0.05, "no answer yet"
            pending = ["/health", *(f"/models/{ep}" for ep in P.ENDPOINTS)]
            while pending:
                # Re-read the published address until the critic answers: an old address
                # (a restarted critic) is replaced by the new one.
                missing = self._locate() if self.run_dir is not None and pending[0] == "/health" else None
                if missing:
                    last = missing
                else:
                    try:
                        req = urllib.request.Request(f"{self.url}/v2{pending[0]}/ready", headers=self._headers)
                        with urllib.request.urlopen(req, timeout=2.0) as r:
                            if r.status == 200:
                                pending.pop(0)
                                continue
                            last = f"HTTP {r.status}"
                    except (urllib.error.URLError, OSError) as e:
                        last = str(getattr(e, "reason", e))
                left = deadline - time.monotonic()
                if left <= 0:
                    what = pending[0].split("/")[-1]
                    raise CriticUnavailableError(
                        f"{self._where(what)}: not ready after {timeout_s:g} s "
                        f"(critic_server.connect_timeout_s={self.connect_timeout_s:g}); last error: {last}")
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)
            self._ready.set()

    def _http(self):
        # tritonclient's HTTP client is not thread-safe: one per worker thread.
        c = getattr(self._local, "client", None)
        if c is None:
            import tritonclient.http as th  # deferred: tritonclient start-up cost, paid on first call
            c = th.InferenceServerClient(url=f"{self.host}:{self.port}",
                                         connection_timeout=self.request_timeout_s,
                                         network_timeout=self.request_timeout_s)
            self._local.client = c
        return c

    def _await_restart(self, broken: bool, failed_at: float) -> bool:
        """After the server dropped a request (at `failed_at`): True once the critic answers
        again, False when within restart_notice_s it neither answers nor withdraws its address
        (it is dead). `broken`: first ask its watchdog for a new tritonserver. Requests that
        failed together wait together: one verdict serves them all."""
        with self._restart_lock:
            if self._recovered_at > failed_at:
                return True
            if failed_at - self._gave_up_at < self.restart_notice_s:
                return False
            if self._wait_for_restart(broken):
                self._recovered_at = time.monotonic()
                return True
            self._gave_up_at = time.monotonic()
            self._ready.set()   # later requests fail at once, naming their endpoint, as before
            return False

    def _wait_for_restart(self, broken: bool) -> bool:
        if broken:
            if self.run_dir is None:
                return False
            asked = self.run_dir.critic_restart_requested
            asked.write_text(f"{self.host}:{self.port}\n")
            deadline = time.monotonic() + self.restart_notice_s
            while asked.exists():
                if time.monotonic() > deadline:
                    asked.unlink(missing_ok=True)
                    return False
                time.sleep(0.05)
            self._ready.clear()
            self.connect()
            return True
        self._ready.clear()
        try:
            self.connect(timeout_s=self.restart_notice_s)
            return True
        except CriticUnavailableError:
            pass
        if self.run_dir is None or address_problem(self.run_dir, self.component, self._secret)[0] is not None:
            return False
        self.connect()   # restarting: the new tritonserver publishes its address when it is up
        return True

    def _call(self, endpoint: str, inputs: dict[str, np.ndarray], outputs: list[str], *,
              retry: bool = True) -> dict[str, np.ndarray]:
        """One request to a Triton model, sent again (RETRIES times at most, with `retry`) when
        the server dropped it and came back; a critic_control command (P.COMMANDS) is sent to
        that model with its `command` input, and errors name the command."""
        if P.REQUEST_ID not in inputs:   # one id per request, kept on its retries
            rid = secrets.randbits(63)
            rows = inputs["lengths"].shape[0] if endpoint == P.INFER else 1
            inputs = {**inputs, P.REQUEST_ID: np.full((rows, 1) if endpoint == P.INFER else (1,), rid, np.int64)}
        for attempt in range(RETRIES + 1):
            sent_at = time.monotonic()
            try:
                return self._send(endpoint, inputs, outputs)
            except _ServerLost as lost:
                if not retry or attempt == RETRIES or not self._await_restart(isinstance(lost, _ServerBroken), sent_at):
                    raise CriticError(str(lost)) from None
        raise AssertionError("unreachable")

    def _send(self, endpoint: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        # deferred: tritonclient start-up cost, paid on first call
        import tritonclient.http as th
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        self.connect()
        label = endpoint
        if endpoint in P.COMMANDS:
            inputs = {"command": np.array([endpoint.encode()], dtype=np.object_), **inputs}
            endpoint = P.CONTROL
        reqs = []
        for name, arr in inputs.items():
            inp = th.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(arr, binary_data=True)
            reqs.append(inp)
        t0 = time.monotonic()
        try:
            # a copy per request: tritonclient writes the request's own Inference-Header-Content-
            # Length into the dict it is given, and concurrent requests would send each other's
            res = self._http().infer(endpoint, reqs, headers=dict(self._headers), outputs=[
                th.InferRequestedOutput(n, binary_data=True) for n in (*outputs, P.REQUEST_ID)])
        except InferenceServerException as e:   # the stub missed its health deadline (server.py)
            kind = _ServerBroken if "is not healthy" in str(e) else CriticError
            raise kind(f"{self._where(label)}: {_server_reason(e.message() or str(e))}") from None
        except Exception as e:  # connection refused/reset, timeouts: the critic is gone or hung
            self._local.client = None  # a broken connection must not be reused
            took = time.monotonic() - t0
            kind = _ServerLost if _server_lost(e) else CriticError
            raise kind(f"{self._where(label)}: request failed after {took:.1f} s "
                       f"(request_timeout_s={self.request_timeout_s:g}): {type(e).__name__}: {e}") from None
        got = {n: res.as_numpy(n) for n in (*outputs, P.REQUEST_ID)}
        sent_id = int(inputs[P.REQUEST_ID].reshape(-1)[0])
        missing = [n for n, a in got.items() if a is None]
        echoed = None if got[P.REQUEST_ID] is None else set(got[P.REQUEST_ID].reshape(-1).tolist())
        if missing or echoed != {sent_id}:
            self._local.client = None   # whatever it holds after this reply is not this request's
            # no outputs: a broken stub's answer (server.py), which a new tritonserver ends;
            # another request's reply: a late one, so this request is simply sent again
            kind = _ServerBroken if missing else _ServerLost
            why = f"without {', '.join(missing)}" if missing else f"for request_id {sorted(echoed)}"
            raise kind(f"{self._where(label)}: a reply {why} came to request_id {sent_id}; "
                       "discarded, not taken as this request's answer")
        return {n: got[n] for n in outputs}

    # -- requests --------------------------------------------------------------------------
    def infer_async(self, tokens: np.ndarray, lengths: np.ndarray, *, timing: bool = False,
                    step: int | None = None) -> Future:
        """Values float32 [B,T] per token and rewards float32 [B] per sequence; with `timing`,
        also the critic's compute time in ms (queueing and transport excluded)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1, 1)
        inputs = {"tokens": tokens, "lengths": lengths}
        if step is not None:
            inputs["step"] = np.full_like(lengths, step)

        def run():
            out = self._call(P.INFER, inputs,
                             ["values", "rewards", "compute_ms"])
            if timing:
                return out["values"], out["rewards"].reshape(-1), float(out["compute_ms"].reshape(-1)[0])
            return out["values"], out["rewards"].reshape(-1)
        return self._pool.submit(run)

    def train_async(self, tokens: np.ndarray, lengths: np.ndarray, returns: np.ndarray,
                    prev_values: np.ndarray, mask: np.ndarray, *, step: int | None = None) -> Future[float]:
        """One value-model update (clipped value loss); the Future gives the loss before it."""
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
        inputs = {"tokens": np.ascontiguousarray(tokens, dtype=np.int64),
                  "lengths": np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1),
                  "returns": f32(returns), "prev_values": f32(prev_values), "mask": f32(mask)}
        if step is not None:
            inputs["step"] = np.array([step], dtype=np.int64)
        inputs[P.REQUEST_ID] = np.array([secrets.randbits(63)], dtype=np.int64)   # one per step, kept on retries
        return self._pool.submit(lambda: float(self._call(P.TRAIN, inputs, ["loss"])["loss"][0]))

    def infer(self, tokens, lengths, *, timing: bool = False, step: int | None = None):
        return self.infer_async(tokens, lengths, timing=timing, step=step).result()

    def train(self, *args, step: int | None = None) -> float:
        return self.train_async(*args, step=step).result()

    def save(self, name: str) -> str:
        """Write the value model's checkpoint `name` into the run's critic checkpoint folder;
        returns its path once it is durable. A path into that folder is taken as its name."""
        if self.run_dir is not None and Path(name).parent == self.run_dir.checkpoints("critic"):
            name = Path(name).name
        arr = np.array([str(name).encode()], dtype=np.object_)
        fut = self._pool.submit(lambda: self._call(P.SAVE, {"name": arr}, ["path"]))
        out = fut.result()["path"].reshape(-1)[0]
        return out.decode() if isinstance(out, bytes) else str(out)

    def shutdown_critic(self) -> None:
        """Ask the critic to stop (all its ranks exit cleanly)."""
        self._pool.submit(lambda: self._call(P.SHUTDOWN, {}, ["ack"], retry=False)).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def share_from_source(value: Any, *, torch_group=None, mpi_comm=None, src: int = 0) -> Any:
    """Broadcast `value` from the group's rank `src` (the rank that called the critic) to
    every rank of a model-parallel group: a torch process group or an mpi4py communicator.
    Other ranks pass None. `src` is the rank within the group."""
    if (torch_group is None) == (mpi_comm is None):
        raise ValueError("share_from_source needs exactly one of torch_group or mpi_comm")
    if mpi_comm is not None:
        return mpi_comm.bcast(value, root=src)
    import torch.distributed as dist  # here: the client itself needs no torch (~1 CPU-s to import)

    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(torch_group, src), group=torch_group)
    return box[0]
