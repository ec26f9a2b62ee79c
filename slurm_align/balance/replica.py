"""Prompt batches for a whole generation replica (a TP group, or TP x PP without refold).

Only the replica's requester (rank 0 of `layout.mp_comm`) asks the server; it broadcasts each
batch to the other ranks of its replica, which must run the same batches in lock-step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from slurm_align.balance.prompts import PromptServer, PromptSource, SpanTracer
from slurm_align.balance.static import StaticPrompts


def open_prompt_source(
    comm: Any,
    layout: Any,
    order: np.ndarray | int,
    *,
    dynamic: bool = True,
    strided: bool = False,
    on_wait: Callable[[float], None] | None = None,
    tracer: SpanTracer | None = None,
    step: int | None = None,
) -> PromptSource:
    """Collective over `comm` (the component's world). `layout` is a GenerationLayout (or any
    object with dp_rank, dp_size, is_requester). dynamic=False is the static-sharding baseline
    (RunConfig switches.dynamic_prompts). Build it inside `pctx.generation_layout(...)`."""
    if dynamic:
        kw = {"order": order} if not isinstance(order, (int, np.integer)) else {"num_prompts": int(order)}
        return PromptServer(comm, requester=layout.is_requester, on_wait=on_wait, tracer=tracer, step=step, **kw)
    return StaticPrompts(order, layout.dp_rank, layout.dp_size, strided=strided, on_wait=on_wait, tracer=tracer,
                         step=step)


def replica_batches(layout: Any, source: PromptSource, batch_size: int) -> Iterator[np.ndarray]:
    """Every rank of a generation replica gets the same batches; only the requester asks."""
    mp = layout.mp_comm
    it = source.batches(batch_size) if layout.is_requester else None
    while True:
        batch = next(it, None) if it is not None else None
        batch = mp.bcast(batch, root=0)
        if batch is None:
            return
        yield batch
