"""The peak of the activation memory autograd holds for the backward pass, measured on any device
(CPU has no allocator peak to read): the distinct storages of the tensors autograd saves, counted
from when they are packed until they are freed (the recomputation inside the backward pass of
activation recompute included); parameters excluded, they are held anyway. A view freed while
its storage lives on through another tensor counts as freed (a slight undercount)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType

import torch


class SavedActivationPeak:
    """`with SavedActivationPeak(model.parameters()) as m: loss.backward()` -> m.peak bytes."""

    def __init__(self, exclude: Iterable[torch.Tensor]):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}   # storage address -> [bytes, saved tensors on it]
        self.now = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self._live[ptr]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._exclude:
            return t
        if ptr not in self._live:
            self._live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.now += self._live[ptr][0]
            self.peak = max(self.peak, self.now)
        self._live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def __enter__(self) -> SavedActivationPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, value, tb)
