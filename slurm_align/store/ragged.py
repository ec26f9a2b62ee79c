"""Ragged sequences as flat values + int64 offsets (n+1), and the growable Zarr arrays behind them."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import zarr
from zarr.codecs import BloscCodec

# lz4 + byte shuffle: the fastest and smallest of the Blosc choices measured here (STACK.md).
COMPRESSOR = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
CHUNK = 1 << 16


def pack(seqs: Sequence[Sequence] | Sequence[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """List of sequences -> (flat values, int64 offsets of length n+1)."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(seqs) and offsets[-1]:
        flat = np.concatenate([np.asarray(s, dtype=dtype).reshape(-1) for s in seqs])
    else:
        flat = np.zeros(0, dtype=dtype)
    return flat, offsets


def unpack(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Inverse of pack (views into flat)."""
    start = int(offsets[0]) if len(offsets) else 0
    return [flat[int(a) - start:int(b) - start] for a, b in zip(offsets[:-1], offsets[1:])]


def growable(group: zarr.Group, name: str, dtype, chunk: int = CHUNK) -> zarr.Array:
    """A 1-D array that starts empty and grows by appends (opened if it already exists)."""
    if name in group:
        return group[name]
    return group.create_array(name, shape=(0,), chunks=(chunk,), dtype=dtype, compressors=COMPRESSOR,
                              fill_value=0)


def write_at(arr: zarr.Array, start: int, values: np.ndarray) -> None:
    """Write values at [start, start+len): the array is resized to end exactly there, so a
    half-written tail left by a killed writer past `start` is cut off and overwritten."""
    end = start + len(values)
    if arr.shape[0] != end:
        arr.resize((end,))
    if len(values):
        arr[start:end] = values
