"""A point-to-point stream of tensor messages between two components of a run, for holders of
the run's secret only: the rollouts (generator -> actor) and the weights (actor -> generator)
of rollout.mode 'disaggregated'.

The server binds one address (the component's own, never every interface), port 0 (the kernel
picks a free one; the caller publishes it, rundir.publish_address). A client proves it holds the
secret by answering a fresh challenge (HMAC-SHA256 of a random nonce), and the server proves it
back; a connection that fails the handshake is closed and the server keeps waiting. Each message
is a safetensors blob (tensors + a JSON header, no pickle) behind an 8-byte length; a reader
thread queues incoming messages, so a sender never waits for the peer to be ready to read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

_CLIENT, _SERVER = b"slurm-align stream client", b"slurm-align stream server"
_NONCE = 32
STOP = "stop"
"""The kind of a peer's last message: it is done and will close (seen by the reader thread at once)."""
MAX_MESSAGE = 1 << 36
"""Refused above this (64 GiB): a corrupt length never allocates the machine's memory."""


class StreamClosed(ConnectionError):
    """The peer closed the stream or died (the message names the peer)."""


class StreamAuthError(ConnectionError):
    """The peer does not hold the run's secret."""


@dataclass
class Message:
    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


def encode(kind: str, meta: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> bytes:
    ts = {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v.detach().contiguous().cpu())
          for k, v in (tensors or {}).items()}
    return st_save(ts, metadata={"kind": kind, "meta": json.dumps(meta or {})})


def decode(blob: bytes) -> Message:
    header_len = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + header_len])
    md = header.get("__metadata__", {})
    tensors = st_load(blob) if len(header) > 1 else {}
    return Message(md["kind"], json.loads(md.get("meta", "{}")), tensors, len(blob))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise StreamClosed("the peer closed the stream")
        got += k
    return bytes(buf)


def _mac(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), role + nonce, hashlib.sha256).digest()


class Stream:
    """One authenticated connection; send from any thread, receive from the queue."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.peer_stopped = False   # the peer sent STOP: a failed send after it is no error
        self._reader = threading.Thread(target=self._read_loop, name=f"stream-{peer}", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        try:
            while True:
                (n,) = struct.unpack("!Q", _recv_exact(self.sock, 8))
                if n > MAX_MESSAGE:
                    raise StreamClosed(f"{self.peer} sent a message of {n} bytes (limit {MAX_MESSAGE})")
                msg = decode(_recv_exact(self.sock, n))
                self.peer_stopped |= msg.kind == STOP
                self._inbox.put(msg)
        except (OSError, ValueError, KeyError) as e:
            self._inbox.put(e if isinstance(e, StreamClosed) else StreamClosed(f"stream from {self.peer}: {e}"))

    def send(self, kind: str, meta: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None) -> int:
        """Queue one message to the peer; returns its size in bytes."""
        blob = encode(kind, meta, tensors)
        with self._send_lock:
            try:
                self.sock.sendall(struct.pack("!Q", len(blob)) + blob)
            except OSError as e:
                raise StreamClosed(f"cannot send to {self.peer}: {e}") from e
        self.bytes_sent += len(blob)
        return len(blob)

    def recv(self, timeout: float | None = None) -> Message:
        """The next message (waits up to `timeout` s; None: forever). StreamClosed when the peer is gone."""
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message from {self.peer} within {timeout} s") from None
        if isinstance(item, Exception):
            self._inbox.put(item)   # every later call sees it too
            raise item
        return item

    def poll(self) -> Message | None:
        """The next message if one is waiting, else None (never blocks)."""
        try:
            return self.recv(timeout=0)
        except TimeoutError:
            return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class StreamServer:
    """Listens on host:0 (a free port, bound before anyone learns it) for one authenticated peer."""

    def __init__(self, host: str, secret: str):
        if host in ("0.0.0.0", "", "::"):
            raise ValueError(
                f"stream bind address {host!r} would listen on every interface; give this host's own address")
        self.secret = secret
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(4)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.refused = 0

    def accept(self, timeout: float) -> Stream:
        """The first peer that proves it holds the secret (others are closed and counted)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no peer connected to {self.host}:{self.port} within {timeout} s")
            self.sock.settimeout(left)
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            try:
                conn.settimeout(30)
                nonce = os.urandom(_NONCE)
                conn.sendall(nonce)
                answer, theirs = _recv_exact(conn, 32), _recv_exact(conn, _NONCE)
                if not hmac.compare_digest(answer, _mac(self.secret, _CLIENT, nonce)):
                    raise StreamAuthError(f"{addr} does not hold the run's secret")
                conn.sendall(_mac(self.secret, _SERVER, theirs))
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return Stream(conn, f"{addr[0]}:{addr[1]}")
            except (OSError, StreamAuthError, StreamClosed):
                self.refused += 1
                conn.close()

    def close(self) -> None:
        self.sock.close()


def connect(host: str, port: int, secret: str, timeout: float = 30.0) -> Stream:
    """A Stream to a StreamServer; StreamAuthError when the server does not hold the secret."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        nonce = _recv_exact(sock, _NONCE)
        mine = os.urandom(_NONCE)
        sock.sendall(_mac(secret, _CLIENT, nonce) + mine)
        if not hmac.compare_digest(_recv_exact(sock, 32), _mac(secret, _SERVER, mine)):
            raise StreamAuthError(f"{host}:{port} does not hold the run's secret")
    except (StreamClosed, OSError) as e:
        sock.close()
        raise StreamAuthError(f"{host}:{port} refused the handshake ({e}): not this run's server, "
                              "or this process lacks the run's secret") from e
    except StreamAuthError:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Stream(sock, f"{host}:{port}")
