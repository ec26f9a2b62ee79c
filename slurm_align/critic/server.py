"""The critic's PyTriton server (critic rank 0): HTTP endpoints -> a queue of commands.

PyTriton calls each endpoint's function on its own handler thread; the models, however, are
driven by rank 0's main thread, which also broadcasts every command to the other critic
ranks (main.py). So the endpoint functions only validate, enqueue a PendingCommand and wait
for its result: every collective runs on one thread, in one order, on every rank.
"""

from __future__ import annotations

import os
import queue
import sysconfig
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from slurm_align.critic import protocol as P
from slurm_align.critic.channel import Command


def put_libpython_first() -> None:
    """PyTriton's Python backend links libpython: make it find the running interpreter's one
    (a venv's or a non-system Python's), or model load fails (STACK.md)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and (not parts or parts[0] != libdir):
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *[p for p in parts if p != libdir]])


def _step(requests) -> int | None:
    """The actor's PPO step carried by the requests (optional input), for the critic's traces."""
    steps = [int(np.max(r["step"])) for r in requests if "step" in r.keys()]
    return max(steps) if steps else None


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


class CriticServer:
    """PyTriton endpoints bound to `host:port` (gRPC port+1, metrics port+2)."""

    def __init__(self, host: str, port: int, limits: ServerLimits):
        if host in ("0.0.0.0", "", "::"):
            raise ValueError(f"critic server bind address {host!r} would listen on every interface; "
                             "give this host's own address (critic_server.bind_host)")
        self.host, self.port, self.limits = host, port, limits
        self.commands: "queue.Queue[PendingCommand]" = queue.Queue()
        self._triton = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        put_libpython_first()
        from pytriton.triton import Triton, TritonConfig

        cfg = TritonConfig(http_address=self.host, grpc_address=self.host, metrics_address=self.host,
                           http_port=self.port, grpc_port=self.port + 1, metrics_port=self.port + 2)
        self._triton = Triton(config=cfg)
        self._bind(self._triton)
        self._triton.run()

    def stop(self) -> None:
        if self._triton is not None:
            self._triton.stop()
            self._triton = None

    def next_command(self, timeout: float | None = None) -> PendingCommand | None:
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def _submit(self, kind: str, data: dict):
        pending = PendingCommand(Command(kind, data))
        self.commands.put(pending)
        return pending.result.result()

    # -- endpoints -------------------------------------------------------------------------
    def _bind(self, triton) -> None:
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor

        i64, f32 = np.int64, np.float32
        lim = self.limits
        triton.bind(P.INFER, self._infer,
                    inputs=[Tensor(name="tokens", dtype=i64, shape=(-1,)),
                            Tensor(name="lengths", dtype=i64, shape=(1,)),
                            Tensor(name="step", dtype=i64, shape=(1,), optional=True)],
                    outputs=[Tensor(name="values", dtype=f32, shape=(-1,)),
                             Tensor(name="rewards", dtype=f32, shape=(1,)),
                             Tensor(name="compute_ms", dtype=f32, shape=(1,))],
                    config=ModelConfig(max_batch_size=lim.max_batch_size, batcher=DynamicBatcher(
                        max_queue_delay_microseconds=lim.max_queue_delay_us)),
                    strict=True)
        triton.bind(P.TRAIN, self._train,
                    inputs=[Tensor(name="tokens", dtype=i64, shape=(-1, -1)),
                            Tensor(name="lengths", dtype=i64, shape=(-1,)),
                            *[Tensor(name=n, dtype=f32, shape=(-1, -1)) for n in P.TRAIN_FLOAT_INPUTS],
                            Tensor(name="step", dtype=i64, shape=(1,), optional=True)],
                    outputs=[Tensor(name="loss", dtype=f32, shape=(1,))],
                    config=ModelConfig(batching=False), strict=True)
        triton.bind(P.SAVE, self._save,
                    inputs=[Tensor(name="path", dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name="path", dtype=np.bytes_, shape=(1,))],
                    config=ModelConfig(batching=False), strict=True)
        triton.bind(P.SHUTDOWN, self._shutdown,
                    inputs=[Tensor(name="flag", dtype=i64, shape=(1,))],
                    outputs=[Tensor(name="ack", dtype=i64, shape=(1,))],
                    config=ModelConfig(batching=False), strict=True)

    def _infer(self, requests) -> list[dict]:
        # The dynamic batcher hands over several requests at once: validate each, run them as
        # one padded batch (causal attention: padding never changes a sequence's values).
        lim = self.limits
        tokens, lengths = [], []
        for r in requests:
            lengths.append(P.validate_tokens(P.INFER, r["tokens"], r["lengths"],
                                             max_seq_len=lim.max_seq_len, vocab_size=lim.vocab_size))
            tokens.append(r["tokens"])
        t0 = time.perf_counter()
        values, rewards = self._submit("infer", {"tokens": P.pad_concat(tokens),
                                                 "lengths": np.concatenate(lengths),
                                                 "step": _step(requests)})
        ms = np.full((1, 1), (time.perf_counter() - t0) * 1e3, dtype=np.float32)
        out, row = [], 0
        for t in tokens:
            b, s = t.shape
            out.append({"values": np.ascontiguousarray(values[row:row + b, :s], dtype=np.float32),
                        "rewards": rewards[row:row + b].astype(np.float32).reshape(b, 1),
                        "compute_ms": np.repeat(ms, b, axis=0)})
            row += b
        return out

    def _train(self, requests) -> list[dict]:
        lim = self.limits
        out = []
        for r in requests:  # one request is one optimizer step
            floats = {n: r[n] for n in P.TRAIN_FLOAT_INPUTS}
            lengths = P.validate_train(r["tokens"], r["lengths"], floats,
                                       max_seq_len=lim.max_seq_len, vocab_size=lim.vocab_size)
            loss = self._submit("train", {"tokens": r["tokens"], "lengths": lengths, **floats,
                                          "step": _step([r])})
            out.append({"loss": np.array([loss], dtype=np.float32)})
        return out

    def _save(self, requests) -> list[dict]:
        out = []
        for r in requests:
            raw = r["path"].reshape(-1)
            if raw.size != 1:
                raise P.CriticPayloadError(f"{P.SAVE}: 'path' must hold exactly one string; got {raw.size}")
            path = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
            if not path:
                raise P.CriticPayloadError(f"{P.SAVE}: 'path' must be a non-empty path")
            written = self._submit("save", {"path": path})
            out.append({"path": np.array([str(written).encode()], dtype=np.bytes_)})
        return out

    def _shutdown(self, requests) -> list[dict]:
        self._submit("shutdown", {})
        return [{"ack": np.array([1], dtype=np.int64)} for _ in requests]
