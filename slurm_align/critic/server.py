"""The critic's PyTriton server (critic rank 0): HTTP endpoints -> a queue of commands.

PyTriton calls each endpoint's function on its own handler thread; the models, however, are
driven by rank 0's main thread, which also broadcasts every command to the other critic
ranks (main.py). So the endpoint functions only validate, enqueue a PendingCommand and wait
for its result: every collective runs on one thread, in one order, on every rank.

Only the run's own actor may call it (compute nodes are reachable by every user of a cluster):
- Triton's restricted-API gate refuses every request (inference, metadata, model control...)
  without the gate token before it reaches a model, so strangers' requests never join the
  dynamic batcher with the actor's. The gate token is derived from the run's secret because
  it stands on tritonserver's command line, which other users of the node can read.
- Each endpoint then checks the run's secret itself (forwarded header, constant-time compare)
  before anything else, and logs refusals (rate-limited).
- Only HTTP is served, on the chosen address; gRPC and metrics are off.
- critic_save takes a checkpoint name and writes only inside the run's critic checkpoint folder.

tritonserver can die under the critic: the Python backend declares a model's stub process dead
when its health thread misses a 1 s deadline (a stalled node: measured here, a stub stopped for
2 s fails the request in flight, and from then on its answers are broken until the next request
aborts tritonserver). A watchdog thread starts a new tritonserver on the same address when it
died or when the actor's client asks for it (RunDir.critic_restart_requested, written on an
'unhealthy' answer), while the models stay in this process. Clients retry (client.py); a
retried critic_train is answered from the first try's result (its request_id), so an
optimizer step is never applied twice.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import queue
import random
import socket
import sys
import sysconfig
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from slurm_align.critic import protocol as P
from slurm_align.critic.channel import Command
from slurm_align.rundir import RunDir, publish_address, read_run_secret


class CriticBindError(RuntimeError):
    """The critic cannot listen on its address: the message names host, port and the setting."""


def put_libpython_first() -> None:
    """PyTriton's Python backend links libpython: make it find the running interpreter's one
    (a venv's or a non-system Python's), or model load fails (STACK.md)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and (not parts or parts[0] != libdir):
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *[p for p in parts if p != libdir]])


def _step(requests) -> int | None:
    """The actor's PPO step carried by the requests (optional input), for the critic's traces."""
    steps = [int(np.max(r["step"])) for r in requests if "step" in r]
    return max(steps) if steps else None


def _echo(request, rows: int) -> np.ndarray:
    """The request's own id for its reply, one per row ([rows, 1]; -1: it sent none)."""
    rid = int(np.asarray(request[P.REQUEST_ID]).reshape(-1)[0]) if P.REQUEST_ID in request else -1
    return np.full((rows, 1), rid, dtype=np.int64)


@dataclass
class PendingCommand:
    command: Command
    result: Future = field(default_factory=Future)


@dataclass(frozen=True)
class ServerLimits:
    max_seq_len: int
    """Longest T the critic's models accept."""
    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_batch_size: int = 1024
    """Largest merged critic_infer batch (rows) the dynamic batcher may form."""
    max_queue_delay_us: int = 500
    """How long the dynamic batcher waits for more critic_infer requests to merge."""
    max_restarts: int = 5
    """How many times tritonserver is started again after it died (while starting, or later by
    the watchdog); one more death ends the critic."""


class RefusalLog:
    """One line per refused request, at most one every `interval_s` (a flood must not fill the
    log): the count since the last line, and the peers connected to the server's port then.
    Triton does not hand the requester's address to the model, so these are the candidates."""

    def __init__(self, port_of, interval_s: float = 10.0, component: str = "critic"):
        self.port_of, self.interval_s, self.component = port_of, interval_s, component
        self._lock = threading.Lock()
        self._last, self._suppressed = -float("inf"), 0

    def refused(self, endpoint: str, why: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._suppressed += 1
                return
            self._last, more, self._suppressed = now, self._suppressed, 0
        print(f"{self.component}: refused a {endpoint} request ({why}); peers connected now: "
              f"{', '.join(connected_peers(self.port_of())) or 'none'}"
              + (f"; {more} more refusals since the last line" if more else ""), file=sys.stderr, flush=True)


def connected_peers(port: int, limit: int = 8) -> list[str]:
    """host:port of the TCP connections established to our `port` (from /proc/net/tcp)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    peers = sorted({f"{c.raddr.ip}:{c.raddr.port}" for c in conns
                    if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port and c.raddr})
    return peers[:limit]


def _listening_ports(pids: set[int]) -> list[tuple[str, int]]:
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except psutil.Error:
            continue
        out += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def proc_hides_other_users(mounts: Path = Path("/proc/mounts")) -> bool:
    """Is /proc mounted with hidepid (other users cannot read our processes' command lines)?"""
    try:
        for line in mounts.read_text().splitlines():
            _, where, fstype, options, *_ = line.split()
            if where == "/proc" and fstype == "proc":
                return any(o.startswith("hidepid=") and o.split("=", 1)[1] not in ("0", "off")
                           for o in options.split(","))
    except OSError:
        pass
    return False


def server_pids() -> set[int]:
    """This process and its children (tritonserver, the Python backend stubs)."""
    me = psutil.Process()
    return {me.pid, *(c.pid for c in me.children(recursive=True))}


TRITON = "tritonserver"
STUB = "triton_python_backend_stub"
SHM_MARK = "pytrtion"   # (sic) PyTriton's prefix of its stubs' shared-memory regions, then its pid


def children_named(*names: str) -> list[psutil.Process]:
    """This process's descendants whose name is one of `names`; one that exits between the
    listing and its naming is left out (tritonserver starts and reaps helpers as it loads)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.name() in names:
                out.append(p)
    return out


def kill_all(procs: list[psutil.Process]) -> None:
    """SIGKILL each, those already gone included."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def stubs_of_this_process() -> list[psutil.Process]:
    """The Python backend stubs of this process's tritonserver, also those a dead tritonserver
    left behind (reparented out of this process's tree, holding its sockets and shared memory):
    PyTriton names the stubs' shared-memory regions `pytrtion<pid>-...` after this process."""
    mark = f"{SHM_MARK}{os.getpid()}-"
    return [p for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] == STUB and any(a.startswith(mark) for a in p.info["cmdline"] or ())]


def ephemeral_ports() -> range:
    """The ports the kernel hands to port-0 binds and to outgoing connections (Linux's
    ip_local_port_range; its usual default where that cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _bindable(host: str, port: int) -> int:
    """`port` (0: one the kernel picks) bound and released on `host`, as Triton binds it."""
    family = socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as Triton binds
        s.bind((host, port))
        return s.getsockname()[1]


PORT_TRIES = 64


def pick_port(host: str, port: int, rng: random.Random | None = None) -> int:
    """`port`, checked to be free on `host` (fail now, not after the actor's connect timeout),
    or with port 0 a free one below the kernel's ephemeral range.

    tritonserver binds the port in another process, after this check and its own start-up
    (seconds on a loaded node). A port from the ephemeral range can be taken meanwhile by any
    process's port-0 listener (MPI's, gloo's, another server's) or outgoing connection; then
    Triton fails to bind, and PyTriton's readiness check talks to the stranger until its 60 s
    network timeout (seen on this project's CI). Below that range only an explicit bind can take
    it. The kernel's own pick is the fallback where the range leaves no room below it."""
    if port:
        try:
            return _bindable(host, port)
        except OSError as e:
            raise CriticBindError(
                f"critic server cannot listen on {host}:{port}: {e.strerror} (another critic or service "
                f"on this node holds it?); set critic_server.port to 0 to pick a free port at start") from None
    ephemeral = ephemeral_ports().start
    below = range(max(1024, ephemeral // 2), ephemeral)
    for candidate in (rng or random.SystemRandom()).sample(below, min(PORT_TRIES, len(below))):
        try:
            return _bindable(host, candidate)
        except OSError:
            continue
    return _bindable(host, 0)


def refusal(endpoint: str, why: str, component: str = "critic") -> P.CriticAuthError:
    return P.CriticAuthError(f"{endpoint}: refused: {why} (header {P.SECRET_HEADER}); "
                             f"only this run's actor may call its {component}")


class CriticServer:
    """PyTriton endpoints bound to `host:port` (HTTP only; port 0: a free port, chosen at start).

    Another served component (the judge: judge/server.py) subclasses it with its own `component`
    name (its published address) and `_bind` (its endpoints): the secured channel is this one."""

    def __init__(self, host: str, port: int, limits: ServerLimits, *, secret: str, checkpoint_dir: Path,
                 run_dir: RunDir | None = None, component: str = "critic"):
        if host in ("0.0.0.0", "", "::"):
            raise ValueError(f"critic server bind address {host!r} would listen on every interface; "
                             "give this host's own address (critic_server.bind_host)")
        self.host, self.port, self.limits = host, port, limits
        self.component = component   # the serving component whose address it publishes
        self._secret = secret.encode()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.run_dir = run_dir
        self.refusals = RefusalLog(lambda: self.port, component=component)
        self.commands: queue.Queue[PendingCommand] = queue.Queue()
        self._triton = None
        self.restarts = 0
        self.failure: BaseException | None = None   # set by the watchdog when it gives up
        self._lifecycle = threading.Lock()   # start, stop and restart, one at a time
        self._stopping = threading.Event()
        # critic_train's request_id -> the Future of its optimizer step (a retry waits on it)
        self._trains: OrderedDict[int, Future] = OrderedDict()
        self._trains_lock = threading.Lock()

    @classmethod
    def for_run(cls, rd: RunDir, host: str, port: int, limits: ServerLimits,
                component: str = "critic") -> CriticServer:
        """The run's critic (or another serving component on the same secured server, e.g. the
        teacher): its secret, its checkpoint folder; publishes its address at start."""
        return cls(host, port, limits, secret=read_run_secret(rd), checkpoint_dir=rd.checkpoints(component),
                   run_dir=rd, component=component)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start tritonserver and bind the endpoints. A tritonserver that dies while it starts
        (on a loaded node its Python backend can abort while a model's stub starts: seen on CI,
        boost::interprocess::lock_exception), or that lost a picked port to another process, is
        started again, on a newly picked port where the configured one is 0, as the watchdog does
        later (ServerLimits.max_restarts in all)."""
        configured = self.port
        with self._lifecycle:
            while True:
                try:
                    self._launch()
                    break
                except Exception as exc:
                    died = self._triton is not None and not self._triton.is_alive()
                    lost = isinstance(exc, CriticBindError) and not configured
                    self._stop_triton(kill=True)
                    if not (died or lost) or self.restarts >= self.limits.max_restarts:
                        raise
                    self.restarts += 1
                    why = "died while starting" if died else "lost its port"
                    print(f"critic: tritonserver on {self.host}:{self.port} {why} ({exc!r}); starting it "
                          f"again (restart {self.restarts} of {self.limits.max_restarts})", file=sys.stderr, flush=True)
                    self.port = configured
        threading.Thread(target=self._watch, name="critic-triton-watchdog", daemon=True).start()

    def _launch(self) -> None:
        put_libpython_first()
        # deferred: pytriton start-up cost (0.4 s), paid by the critic's server only
        from pytriton.triton import VALID_TRITON_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig

        self.port = pick_port(self.host, self.port)
        cfg = TritonConfig(http_address=self.host, http_port=self.port, allow_grpc=False, allow_metrics=False,
                           allow_sagemaker=False, allow_vertex_ai=False,
                           http_header_forward_pattern=P.SECRET_HEADER)
        # Everything but health (PyTriton's own start-up polls it without the token) is gated.
        security = TritonSecurityConfig(access_token=P.gate_token(self._secret.decode()),
                                        restricted_endpoints=sorted(VALID_TRITON_ENDPOINTS - {"health"}))
        self._triton = Triton(config=cfg, security_config=security)
        self._bind(self._triton)
        self._triton.run()
        # Another process that took the port between the check and Triton's bind would answer
        # in our place: make sure the listener is ours.
        mine = _listening_ports(server_pids())
        if not any(port == self.port for _, port in mine):
            self._stop_triton(kill=True)   # not stop(): start() or the watchdog holds the lifecycle lock
            raise CriticBindError(f"critic server: tritonserver is not listening on {self.host}:{self.port} "
                                  "(taken by another process meanwhile?); start again or set another "
                                  "critic_server.port")
        if self.run_dir is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            publish_address(self.run_dir, self.component, self.host, self.port, self._secret.decode())
        if not proc_hides_other_users() and not self.restarts:
            print("critic: note: /proc is not mounted with hidepid, so other users of this node can read "
                  "tritonserver's command line and on it the Triton gate token (not the run's secret): "
                  "it takes them past Triton's gate, to the critic's own check of the secret and to "
                  "Triton's model-control API. Cluster admins close this with hidepid=2.", file=sys.stderr,
                  flush=True)

    def stop(self) -> None:
        self._stopping.set()
        with self._lifecycle:
            self._stop_triton()

    def _stop_triton(self, kill: bool = False) -> None:
        if self._triton is not None:
            if self.run_dir is not None:   # no address: clients wait for the next one
                self.run_dir.address(self.component).unlink(missing_ok=True)
            if kill:   # a broken tritonserver would wait its exit timeout (30 s) for a lost answer;
                # a dead tritonserver's stubs outlive it
                kill_all(children_named(TRITON) + stubs_of_this_process())
            self._triton.stop()
            self._triton = None
            if kill:   # killed stubs never unlink their shared memory (4 MiB each, in /dev/shm)
                for region in Path("/dev/shm").glob(f"{SHM_MARK}{os.getpid()}-*"):
                    region.unlink(missing_ok=True)

    def _watch(self, interval_s: float = 0.25) -> None:
        """Start tritonserver again when it died (not when stop() stopped it)."""
        asked = None if self.run_dir is None or self.component != "critic" else self.run_dir.critic_restart_requested
        if asked is not None:
            asked.unlink(missing_ok=True)   # an earlier job's request is not this server's
        while not self._stopping.wait(interval_s):
            with self._lifecycle:
                if self._stopping.is_set() or self._triton is None:
                    continue
                why = "died" if not self._triton.is_alive() else None
                if why is None and asked is not None and asked.exists():
                    why = "answered that a model's stub is unhealthy"
                if why is None:
                    continue
                if self.restarts >= self.limits.max_restarts:
                    self.failure = RuntimeError(
                        f"critic server: tritonserver on {self.host}:{self.port} {why} again after "
                        f"{self.restarts} restarts (ServerLimits.max_restarts={self.limits.max_restarts})")
                    self._stop_triton(kill=True)
                    return
                self.restarts += 1
                print(f"critic: tritonserver on {self.host}:{self.port} {why}; starting it again "
                      f"(restart {self.restarts} of {self.limits.max_restarts})", file=sys.stderr, flush=True)
                try:
                    self._stop_triton(kill=True)
                    if asked is not None:   # taken: the old address is withdrawn, the old server gone
                        asked.unlink(missing_ok=True)
                    self._launch()
                except BaseException as exc:   # the port taken meanwhile, or Triton cannot start
                    self.failure = exc
                    return

    def next_command(self, timeout: float | None = None) -> PendingCommand | None:
        if self.failure is not None:
            raise self.failure
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def _submit(self, kind: str, data: dict):
        return self._enqueue(kind, data).result()

    def _enqueue(self, kind: str, data: dict) -> Future:
        pending = PendingCommand(Command(kind, data))
        self.commands.put(pending)
        return pending.result

    # -- authorization ---------------------------------------------------------------------
    def _refused(self, endpoint: str, request) -> str | None:
        """Why `request` is refused (logged), or None when it carries this run's secret; the
        comparison takes the same time however much of a wrong secret matches."""
        params = {str(k).lower(): v for k, v in (request.parameters or {}).items()}
        given = params.get(P.SECRET_HEADER)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._secret):
            return None
        why = "no run secret" if given is None else "wrong run secret"
        self.refusals.refused(endpoint, why)
        return why

    def _authorize(self, endpoint: str, requests) -> None:
        """Refuse the call unless every request carries this run's secret."""
        for r in requests:
            why = self._refused(endpoint, r)
            if why:
                raise refusal(endpoint, why, self.component)

    def _checkpoint_target(self, name: str) -> str:
        """The name, once sure that writing it (and the worker's `<stem>/` folder beside it)
        stays inside the checkpoint folder: no symlink on the way out."""
        folder = self.checkpoint_dir
        for path in (folder, folder / name, folder / Path(name).stem):
            if path.is_symlink():
                raise P.CriticPayloadError(f"{P.SAVE}: refused: {path} is a symlink; the critic writes "
                                           f"only inside {folder}")
        if (folder / name).resolve().parent != folder.resolve():
            raise P.CriticPayloadError(f"{P.SAVE}: refused: {name!r} leads outside {folder}")
        return name

    # -- endpoints -------------------------------------------------------------------------
    def _bind(self, triton) -> None:
        # deferred: pytriton start-up cost (0.4 s), paid by the critic's server only
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

        i64, f32 = np.int64, np.float32
        lim = self.limits
        triton.bind(P.INFER, self._infer,
                    inputs=[Tensor(name="tokens", dtype=i64, shape=(-1,)),
                            Tensor(name="lengths", dtype=i64, shape=(1,)),
                            Tensor(name="step", dtype=i64, shape=(1,), optional=True),
                            Tensor(name=P.REQUEST_ID, dtype=i64, shape=(1,), optional=True)],
                    outputs=[Tensor(name="values", dtype=f32, shape=(-1,)),
                             Tensor(name="rewards", dtype=f32, shape=(1,)),
                             Tensor(name="compute_ms", dtype=f32, shape=(1,)),
                             Tensor(name=P.REQUEST_ID, dtype=i64, shape=(1,))],
                    config=ModelConfig(max_batch_size=lim.max_batch_size, batcher=DynamicBatcher(
                        max_queue_delay_microseconds=lim.max_queue_delay_us)),
                    strict=True)
        # train, save and shutdown share one model: each model is one more Python backend
        # process for Triton to start and stop (~2 s each, on every run's critical path).
        triton.bind(P.CONTROL, self._control,
                    inputs=[Tensor(name="command", dtype=np.bytes_, shape=(1,)),
                            Tensor(name="tokens", dtype=i64, shape=(-1, -1), optional=True),
                            Tensor(name="lengths", dtype=i64, shape=(-1,), optional=True),
                            *[Tensor(name=n, dtype=f32, shape=(-1, -1), optional=True) for n in P.TRAIN_FLOAT_INPUTS],
                            Tensor(name="step", dtype=i64, shape=(1,), optional=True),
                            Tensor(name=P.REQUEST_ID, dtype=i64, shape=(1,), optional=True),
                            Tensor(name="name", dtype=np.bytes_, shape=(1,), optional=True)],
                    outputs=[Tensor(name="loss", dtype=f32, shape=(1,)),
                             Tensor(name="path", dtype=np.bytes_, shape=(1,)),
                             Tensor(name="ack", dtype=i64, shape=(1,)),
                             Tensor(name=P.REQUEST_ID, dtype=i64, shape=(1,))],
                    config=ModelConfig(batching=False), strict=True)

    def _infer(self, requests) -> list[dict]:
        # The dynamic batcher hands over several requests at once: validate each, run them as
        # one padded batch (causal attention: padding never changes a sequence's values).
        # PyTriton can fail only a whole batch: a refused request merged with the actor's (only
        # one holding the gate token gets that far) is answered with NaNs instead, so that it
        # cannot fail the actor's requests; it is logged like every refusal.
        why = [self._refused(P.INFER, r) for r in requests]
        served = [w is None for w in why]
        if not any(served):
            raise refusal(P.INFER, why[0], self.component)
        lim = self.limits
        tokens, lengths = [], []
        for r, ok in zip(requests, served):
            if ok:
                lengths.append(P.validate_tokens(P.INFER, r["tokens"], r["lengths"],
                                                 max_seq_len=lim.max_seq_len, vocab_size=lim.vocab_size))
                tokens.append(r["tokens"])
        t0 = time.perf_counter()
        values, rewards = self._submit("infer", {"tokens": P.pad_concat(tokens),
                                                 "lengths": np.concatenate(lengths),
                                                 "step": _step([r for r, ok in zip(requests, served) if ok])})
        ms = np.full((1, 1), (time.perf_counter() - t0) * 1e3, dtype=np.float32)
        out, row = [], 0
        for r, ok in zip(requests, served):
            b, s = r["tokens"].shape[:2]
            if not ok:
                nan = np.full((b, 1), np.nan, np.float32)
                out.append({"values": np.full((b, s), np.nan, np.float32), "rewards": nan, "compute_ms": nan,
                            P.REQUEST_ID: np.full((b, 1), -1, np.int64)})   # nothing of it is read
                continue
            out.append({"values": np.ascontiguousarray(values[row:row + b, :s], dtype=np.float32),
                        "rewards": rewards[row:row + b].astype(np.float32).reshape(b, 1),
                        "compute_ms": np.repeat(ms, b, axis=0), P.REQUEST_ID: _echo(r, b)})
            row += b
        return out

    def _control(self, requests) -> list[dict]:
        # The secret first: nothing of a stranger's request is read before it is checked.
        self._authorize(P.CONTROL, requests)
        handlers = {P.TRAIN: self._train, P.SAVE: self._save, P.SHUTDOWN: self._shutdown}
        return [{**handlers[P.validate_command(r["command"], set(r.keys()))](r), P.REQUEST_ID: _echo(r, 1)[0]}
                for r in requests]

    def _train(self, r) -> dict:   # one request is one optimizer step
        lim = self.limits
        floats = {n: r[n] for n in P.TRAIN_FLOAT_INPUTS}
        lengths = P.validate_train(r["tokens"], r["lengths"], floats,
                                   max_seq_len=lim.max_seq_len, vocab_size=lim.vocab_size)
        data = {"tokens": r["tokens"], "lengths": lengths, **floats, "step": _step([r])}
        if P.REQUEST_ID not in r:
            return {"loss": np.array([self._submit("train", data)], dtype=np.float32)}
        rid = int(np.asarray(r[P.REQUEST_ID]).reshape(-1)[0])
        with self._trains_lock:   # a retry of a step already taken gets that step's loss
            step = self._trains.get(rid)
            if step is None:
                step = self._trains[rid] = self._enqueue("train", data)
                while len(self._trains) > 256:
                    self._trains.popitem(last=False)
        return {"loss": np.array([step.result()], dtype=np.float32)}

    def _save(self, r) -> dict:
        name = self._checkpoint_target(P.validate_checkpoint_name(r["name"]))
        written = self._submit("save", {"path": name})
        return {"path": np.array([str(written).encode()], dtype=np.bytes_)}

    def _shutdown(self, r) -> dict:
        self._submit("shutdown", {})
        return {"ack": np.array([1], dtype=np.int64)}
