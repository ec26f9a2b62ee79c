"""Weights over a torch process group (rollout.weight_transport 'collective'), with the
authenticated stream (generation/stream.py) as its control plane.

The stream admits only holders of the run's secret; a gloo group authenticates nobody (neither
a TCPStore nor gloo's pair sockets check who connects). So:
- rendezvous: the group's store is the stream itself (StreamStore): the two members exchange
  their pair addresses there, never through a TCPStore that another user of the cluster could
  reach;
- binding: each member's gloo device binds its own service address, never every interface;
- integrity: for each bucket the trainer sends over the stream its names, shapes, dtypes and
  the sha256 of its bytes; the generator hashes what the group delivered and refuses a bucket
  that differs, so a stranger who reaches a gloo socket can at most break the run, never change
  the weights it generates with.
Members: 0 is the trainer's global rank 0 (it holds the weights gathered from every TP x PP
shard), 1 the generator's rank 0 (it hands them to its other ranks, as with the stream). The
trainer posts each bucket's broadcast and goes on (gloo's threads carry it); the generator
takes it when it applies weights, between requests.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from slurm_align.generation.stream import Message, Stream
from slurm_align.generation.weight_stream import KIND, buckets

STORE = "store"
"""Stream messages of the rendezvous: one key and its value."""
META = "weights_meta"
"""Stream message before each bucket's broadcast: what the group will carry, and its sha256."""
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}


class WeightTamperError(RuntimeError):
    """A bucket that came over the process group does not match what the trainer announced."""


class StreamStore(dist.Store):
    """The store of a two-member group, over the authenticated stream: `set` sends the key to the
    peer (and keeps it), `get`/`wait` read the stream until the key has come. Gloo's rendezvous
    uses only these; the counters and compare-and-set of a shared store have no meaning here."""

    def __init__(self, stream: Stream, timeout_s: float):
        super().__init__()
        self.stream, self.timeout_s, self.keys = stream, timeout_s, {}

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.keys[key] = value
        t = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)
        self.stream.send(STORE, {"key": key}, {"value": t})

    def _until(self, keys) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not all(k in self.keys for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"weight group rendezvous: no key {sorted(set(keys) - set(self.keys))} from "
                                   f"{self.stream.peer} within {self.timeout_s} s")
            msg = self.stream.recv(timeout=left)
            if msg.kind != STORE:
                raise RuntimeError(f"weight group rendezvous: {self.stream.peer} sent {msg.kind!r}, expected {STORE!r}")
            self.keys[msg.meta["key"]] = msg.tensors["value"].numpy().tobytes()

    def get(self, key: str) -> bytes:
        self._until([key])
        return self.keys[key]

    def wait(self, keys, timeout=None) -> None:
        self._until(list(keys))

    def check(self, keys) -> bool:
        return all(k in self.keys for k in keys)

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("StreamStore serves a two-member rendezvous: set, get, wait and check only")

    add = compare_set = delete_key = num_keys = _unsupported


def open_group(stream: Stream, member: int, host: str, timeout_s: float) -> dist.ProcessGroup:
    """Both members call it, at the same point of their conversation (after the start message):
    a gloo group of 2 whose pair sockets bind `host` only."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(StreamStore(stream, timeout_s), member, 2, opts)


def _sha256(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class GroupSender:
    """The trainer's end: per bucket, META over the stream, then an asynchronous broadcast."""

    def __init__(self, stream: Stream, group: dist.ProcessGroup):
        self.stream, self.group = stream, group
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []   # buffers live until delivered

    def send(self, state_dict: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> int:
        """Post one version; returns the bytes the group carries."""
        self.pending = [(w, b) for w, b in self.pending if not w.is_completed()]
        parts, sent = buckets(state_dict, bucket_bytes), 0
        for i, names in enumerate(parts):
            ts = [state_dict[n].detach().cpu().contiguous() for n in names]
            # a copy: the next optimizer step changes the parameters before the peer may take them
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ts])
            self.stream.send(META, {"version": int(version), "bucket": i, "buckets": len(parts), "names": names,
                                    "shapes": [list(t.shape) for t in ts], "dtypes": [str(t.dtype) for t in ts],
                                    "sha256": _sha256(flat)})
            self.pending.append((self.group.broadcast(flat, 0), flat))
            sent += flat.numel()
        return sent

    def close(self, timeout_s: float) -> None:
        """Wait until the generator has taken every posted bucket."""
        for work, _ in self.pending:
            work.wait(timedelta(seconds=timeout_s))
        self.pending = []


class GroupReceiver:
    """The generator's end: a META message in, the bucket's "weights" message (as the stream
    would have carried it, for the WeightAssembler) out."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def receive(self, meta_msg: Message) -> Message:
        m = meta_msg.meta
        for d in m["dtypes"]:
            if d not in _DTYPES:
                raise WeightTamperError(f"weight bucket {m['bucket']} of version {m['version']}: dtype {d!r} "
                                        f"(allowed {sorted(_DTYPES)})")
        dtypes = [_DTYPES[d] for d in m["dtypes"]]
        sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(m["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        self.group.broadcast(flat, 0).wait()
        if _sha256(flat) != m["sha256"]:
            raise WeightTamperError(f"weight bucket {m['bucket']} of version {m['version']} from the process group "
                                    "differs from what the trainer announced over the authenticated stream: refused")
        tensors, offset = {}, 0
        for name, shape, dtype, size in zip(m["names"], m["shapes"], dtypes, sizes):
            part = flat[offset:offset + size]
            part = part if offset % dtype.itemsize == 0 else part.clone()   # a view needs aligned storage
            tensors[name] = part.view(dtype).reshape(shape)
            offset += size
        return Message(KIND, {"version": m["version"], "bucket": m["bucket"], "buckets": m["buckets"]}, tensors)
