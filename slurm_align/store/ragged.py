"""Ragged sequences as flat values + int64 offsets (n+1), and the growable Zarr arrays behind the stores.

Arrays grow by capacity (doubling), not by one resize per append: a resize rewrites the array's
zarr.json, so growing by exactly the appended amount cost a metadata write per array per append.
How much of an array is valid is recorded by the store's commit (an attribute written last).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numcodecs
import numpy as np
import zarr
from zarr.codecs import BloscCodec, BytesCodec

from slurm_align.store.atomic import AtomicLocalStore

# lz4 + byte shuffle: the fastest and smallest of the Blosc choices measured here (STACK.md).
COMPRESSOR = BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
_SHUFFLE = {"noshuffle": numcodecs.Blosc.NOSHUFFLE, "shuffle": numcodecs.Blosc.SHUFFLE,
            "bitshuffle": numcodecs.Blosc.BITSHUFFLE}


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
    return [flat[int(a) - start:int(b) - start] for a, b in itertools.pairwise(offsets)]


def next_pow2(n: int, floor: int = 1) -> int:
    return max(int(floor), 1 << max(int(n) - 1, 0).bit_length())


def create(group: zarr.Group, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], dtype) -> zarr.Array:
    """An array of `shape` (a capacity: grown later with `ensure_shape`), opened if it exists."""
    if name in group:
        return group[name]
    return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=COMPRESSOR,
                              fill_value=0)


def ensure_shape(arr: zarr.Array, needed: tuple[int, ...]) -> None:
    """Grow `arr` (each axis to the next power of two) so that it holds at least `needed`.
    Never shrinks: data past a store's commit is ignored by readers and overwritten by writers."""
    if all(have >= want for have, want in zip(arr.shape, needed)):
        return
    arr.resize(tuple(have if have >= want else next_pow2(want) for have, want in zip(arr.shape, needed)))


def put_chunk(arr: zarr.Array, coords: tuple[int, ...], block: np.ndarray) -> None:
    """Write one whole chunk: encoded with the array's own codecs (bytes, then Blosc) and put
    atomically, synchronously. Zarr's async write path costs about 0.6 ms per call on top of the
    file write, more than the file write itself for a step's rows (bench_store.py); arrays with
    other codecs or stores go through zarr's setitem. tests/unit/store/test_rollouts.py checks that
    the bytes equal zarr's own."""
    block = np.asarray(block, dtype=arr.dtype)
    if block.shape != arr.chunks:
        raise ValueError(f"put_chunk: block shape {block.shape} is not the chunk shape {arr.chunks}")
    store = arr.store
    codecs = arr.metadata.codecs
    direct = (isinstance(store, AtomicLocalStore) and len(codecs) == 2 and isinstance(codecs[0], BytesCodec)
              and isinstance(codecs[1], BloscCodec))
    if not direct:
        arr[tuple(slice(c * n, (c + 1) * n) for c, n in zip(coords, arr.chunks))] = block
        return
    blosc = codecs[1]
    encoder = numcodecs.Blosc(cname=blosc.cname.value, clevel=blosc.clevel, shuffle=_SHUFFLE[blosc.shuffle.value],
                              blocksize=blosc.blocksize, typesize=blosc.typesize)
    raw = np.ascontiguousarray(block, dtype=block.dtype.newbyteorder("<"))
    key = f"{arr.path}/{arr.metadata.encode_chunk_key(coords)}"
    store.put_bytes(key, encoder.encode(raw))


def write_row(arr: zarr.Array, row: int, values: np.ndarray) -> None:
    """Write `values` at the start of row `row` of a 2-D array chunked one row high: the chunks
    they cover are written whole (zero padded), without reading them back first; chunks past them
    are left as they are (readers take each row's length from the store's index). The array must
    already be wide enough."""
    width = arr.chunks[1]
    chunks = max(1, -(-len(values) // width))
    full = np.zeros(chunks * width, dtype=arr.dtype)
    full[:len(values)] = values
    for j in range(chunks):
        put_chunk(arr, (row, j), full[None, j * width:(j + 1) * width])
