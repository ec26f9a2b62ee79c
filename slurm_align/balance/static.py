"""Static prompt sharding: the baseline the work-stealing server is measured against.

Each generation DP rank gets a fixed slice of the indices, contiguous or strided; slice sizes
differ by at most one, and together the slices are the whole set exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from slurm_align.balance.prompts import SpanTracer, _check_batch_size, _Timed


def static_shard(order: np.ndarray | int, rank: int, size: int, *, strided: bool = False) -> np.ndarray:
    """This rank's fixed share of `order` (or of range(order) when an int is given)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"static_shard: need 0 <= rank < size, got rank={rank}, size={size}")
    order = np.arange(order, dtype=np.int64) if isinstance(order, (int, np.integer)) else np.asarray(order, np.int64)
    if strided:
        return order[rank::size]
    bounds = np.linspace(0, len(order), size + 1).round().astype(int)  # sizes differ by <= 1
    return order[bounds[rank] : bounds[rank + 1]]


class StaticPrompts:
    """Same interface as PromptServer (batches, wait_times, close) over a fixed shard."""

    def __init__(
        self,
        order: np.ndarray | int,
        rank: int,
        size: int,
        *,
        strided: bool = False,
        on_wait: Callable[[float], None] | None = None,
        tracer: SpanTracer | None = None,
        step: int | None = None,
    ):
        self.shard = static_shard(order, rank, size, strided=strided)
        self._timed = _Timed(on_wait, tracer, 0 if step is None else step)

    @property
    def wait_times(self) -> list[float]:
        return self._timed.wait_times

    def batches(self, batch_size: int) -> Iterator[np.ndarray]:
        _check_batch_size(batch_size)
        for start in range(0, len(self.shard), batch_size):
            yield self._timed.call(lambda s: self.shard[s : s + batch_size], start)

    def close(self) -> None:
        pass

    def __enter__(self) -> StaticPrompts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
