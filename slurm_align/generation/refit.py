"""Refit: training weights (TP x PP shards) -> this rank's generation engine, timed.

With refold on, every rank of a TP x PP model replica ends up holding the whole model for
generation (DP_gen = DP x PP, see slurm_align.parallel.layout.GenerationLayout); the torch engines
compute at TP 1, so each rank gets the full state dict (TP all-gather + PP exchange inside
slurm_align.models.weights.full_state_dict). The TensorRT-LLM engine slices its own TP shard
from the same dict. A LoRA model's adapters are merged into each shard first (lora.merged).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from slurm_align.generation.base import Engine
from slurm_align.models.lora import merged
from slurm_align.models.weights import full_state_dict, local_tensors


@dataclass(frozen=True)
class RefitResult:
    seconds: float
    """Wall time of the whole refit (gather + engine load)."""
    gather_seconds: float
    """Collecting the full weights from the TP x PP shards (collective)."""
    load_seconds: float
    """Copying them into the engine (in place after the first refit)."""
    layout: Any
    """The GenerationLayout this rank generates in."""


def refit_from_training(engine: Engine, chunks: list, pctx: Any, *, refold: bool = True) -> RefitResult:
    """Collective over all training ranks: gather the full weights and refit `engine`.

    Call it on every rank with the same `refold`; generate inside the returned layout (its
    dp_rank/dp_size say which share of the prompts this rank serves).
    """
    t0 = time.perf_counter()
    # LoRA: the engine generates with the merged weights W + scale * B A
    with pctx.generation_layout(refold) as layout, merged(chunks):
        if pctx.tp_size == 1 and pctx.pp_size == 1 and getattr(pctx, "ep_size", 1) == 1:
            # Nothing to gather: the engine copies straight from the parameters (no extra clone).
            weights = {name: t.detach() for name, t in local_tensors(chunks, pctx)}
        else:
            weights = full_state_dict(chunks, pctx, to_all=True)
        t1 = time.perf_counter()
        engine.refit(weights)
        t2 = time.perf_counter()
    return RefitResult(t2 - t0, t1 - t0, t2 - t1, layout)
