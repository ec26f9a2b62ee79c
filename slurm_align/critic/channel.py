"""Rank 0 -> follower ranks: the command stream of the critic component.

Rank 0 receives requests over HTTP; every other critic rank must run the same collective
forward/backward, so rank 0 broadcasts each command (its kind and its data) over the
component's MPI communicator. Followers wait with a non-blocking broadcast polled at a
short interval: a blocking MPI call would busy-spin a core for as long as the critic is
idle, stealing it from the actor on shared nodes. A command's data travels as an .npz
(arrays, numbers, strings; loaded without pickle), never as a pickle.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurm_align.parallel import quiet

KINDS = ("infer", "train", "save", "shutdown")


@dataclass
class Command:
    kind: str
    """One of KINDS."""
    data: dict[str, Any] = field(default_factory=dict)
    """Arrays and values the command needs (the same on every rank)."""


class CommandChannel:
    """Broadcast of Commands from `root` to all ranks of `comm` (an mpi4py communicator)."""

    def __init__(self, comm, root: int = 0, poll_s: float = 0.001):
        self.comm = comm
        self.root = root
        self.poll_s = poll_s

    @property
    def is_root(self) -> bool:
        return self.comm.Get_rank() == self.root

    def send(self, cmd: Command) -> None:
        """Root only: every follower's recv() returns an equal Command."""
        if cmd.kind not in KINDS:
            raise ValueError(f"unknown critic command {cmd.kind!r}; expected one of {KINDS}")
        if self.comm.Get_size() == 1:
            return
        payload = encode_data(cmd.data)
        header = np.array([KINDS.index(cmd.kind), len(payload)], dtype=np.int64)
        self.comm.Ibcast(header, root=self.root).Wait()
        self.comm.Bcast(np.frombuffer(payload, dtype=np.uint8), root=self.root)

    def recv(self) -> Command:
        """Followers: wait (without spinning a core) for the next command from root."""
        header = np.zeros(2, dtype=np.int64)
        quiet.wait(self.comm.Ibcast(header, root=self.root), self.poll_s)
        buf = np.empty(int(header[1]), dtype=np.uint8)
        self.comm.Bcast(buf, root=self.root)
        return Command(KINDS[int(header[0])], decode_data(buf.tobytes()))


def encode_data(data: dict[str, Any]) -> bytes:
    """Arrays, numbers, strings and None values -> .npz bytes (None: listed under a reserved key)."""
    none = [k for k, v in data.items() if v is None]
    arrays = {k: np.asarray(v) for k, v in data.items() if v is not None}
    for k, a in arrays.items():
        if a.dtype == object:
            raise TypeError(f"critic command data {k!r} is not an array, number or string")
    out = io.BytesIO()
    np.savez(out, __none__=np.array(none, dtype=np.str_), **arrays)
    return out.getvalue()


def decode_data(payload: bytes) -> dict[str, Any]:
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        data = {k: (z[k].item() if z[k].ndim == 0 else z[k]) for k in z.files if k != "__none__"}
        data.update({str(k): None for k in z["__none__"]})
    return data
