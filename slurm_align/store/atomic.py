"""A Zarr LocalStore whose every key is written atomically (temp file + os.replace).

zarr 3.0's LocalStore writes files in place, so a reader can meet a half-written chunk or
zarr.json while a writer appends. With each key replaced atomically, a reader sees either the
old or the new file; since writers only ever append past the committed count (and commit by
rewriting an attribute last), every committed element a reader asks for is always intact.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore


def _put_atomic(path: Path, data, exclusive: bool, fsync: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    if exclusive:
        try:
            os.link(tmp, path)  # fails if the key exists, like open(mode="xb")
        finally:
            os.unlink(tmp)
    else:
        os.replace(tmp, path)


class AtomicLocalStore(LocalStore):
    """LocalStore with atomic key writes. `fsync=True` also survives a machine crash (slower)."""

    def __init__(self, root: Path | str, *, read_only: bool = False, fsync: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.fsync = fsync

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        if not self._is_open:
            await self._open()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"AtomicLocalStore.set(): value must be a Buffer, got {type(value)}")
        await asyncio.to_thread(_put_atomic, self.root / key, value.as_buffer_like(), exclusive, self.fsync)

    def put_bytes(self, key: str, data: bytes) -> None:
        """Synchronous atomic write of one key (for callers that encoded a chunk themselves)."""
        self._check_writable()
        _put_atomic(self.root / key, data, False, self.fsync)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AtomicLocalStore) and self.root == other.root
