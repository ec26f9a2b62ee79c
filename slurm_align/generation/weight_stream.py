"""Weights over a Stream, in buckets: the trainer's full (TP=1, PP=1) state dict after an
optimizer step, to the generator, which applies a version only once all its buckets arrived
(no request ever sees half-updated weights)."""

from __future__ import annotations

import torch

from slurm_align.generation.stream import Message, Stream
from slurm_align.generation.trtllm_engine import layer_buckets

KIND = "weights"


def buckets(state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names in order, in buckets of whole layers of at most bucket_bytes (a larger layer is a
    bucket alone): the grouping the TensorRT-LLM refit uses."""
    return layer_buckets(list(state_dict), {n: t.numel() * t.element_size() for n, t in state_dict.items()},
                         bucket_bytes)


def send_weights(stream: Stream, state_dict: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> int:
    """Send one version; returns the bytes sent."""
    parts = buckets(state_dict, bucket_bytes)
    sent = 0
    for i, names in enumerate(parts):
        sent += stream.send(KIND, {"version": int(version), "bucket": i, "buckets": len(parts)},
                            {n: state_dict[n] for n in names})
    return sent


class WeightAssembler:
    """Collects a version's buckets; `feed` returns (version, full state dict) at its last one."""

    def __init__(self) -> None:
        self._version: int | None = None
        self._parts: dict[str, torch.Tensor] = {}
        self._next = 0

    def feed(self, msg: Message) -> tuple[int, dict[str, torch.Tensor]] | None:
        m = msg.meta
        if msg.kind != KIND:
            raise ValueError(f"expected a weights message, got {msg.kind!r}")
        if m["bucket"] == 0:
            self._version, self._parts, self._next = int(m["version"]), {}, 0
        if int(m["version"]) != self._version or int(m["bucket"]) != self._next:
            raise ValueError(f"weight bucket {m['bucket']} of version {m['version']} arrived out of order "
                             f"(expected bucket {self._next} of version {self._version})")
        self._parts.update(msg.tensors)
        self._next += 1
        if self._next < int(m["buckets"]):
            return None
        done, self._parts = self._parts, {}
        return self._version, done
