"""The one optimizer step of every trained model (the SFT/RM/DPO trainers, the PPO actor, the
critic): gradients summed over data parallelism (experts over their own replicas), clipped to
the global norm over TP x PP (x EP), then the update. Below algorithms/ and critic/, which
both train with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from slurm_align.models.weights import sync_tied_embedding_grads


def reduce_gradients(params: list, pctx: Any, clip: float | None) -> float:
    """Sum gradients over DP (one flat all-reduce), clip them to the global norm over TP x PP and
    return that norm. Parameters without a gradient get zeros, so every rank joins the same
    collectives. Call it through optimizer_step."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sync_tied_embedding_grads(params)  # tied embeddings under PP > 1: first + last stage
    grads = [p.grad for p in params]
    # MoE under expert parallelism: an expert's replicas are the DP / EP ranks holding it
    # (megatron marks its weights allreduce=False), every other weight's all DP ranks.
    ep = getattr(pctx, "ep_size", 1)
    expert = [ep > 1 and not getattr(p, "allreduce", True) for p in params]
    for part, group, size in (([g for g, e in zip(grads, expert) if not e], pctx.dp_group, pctx.dp_size),
                              ([g for g, e in zip(grads, expert) if e], getattr(pctx, "edp_group", None),
                               pctx.dp_size // ep)):
        if part and size > 1:
            flat = torch._utils._flatten_dense_tensors(part)
            dist.all_reduce(flat, group=group)
            for g, r in zip(part, torch._utils._unflatten_dense_tensors(flat, part)):
                g.copy_(r)
    # Global grad norm over TP x PP (x EP for experts); TP-replicated params are counted once (tp rank 0).
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    sq_experts = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for p, e in zip(params, expert):
        if (getattr(p, "tensor_model_parallel", False) or pctx.tp_rank == 0) and not getattr(p, "tied_copy", False):
            (sq_experts if e else sq).add_(p.grad.double().pow(2).sum())
    if ep > 1:
        dist.all_reduce(sq_experts, group=pctx.ep_group)  # each EP rank holds other experts
    sq += sq_experts
    if pctx.tp_size * pctx.pp_size > 1:
        dist.all_reduce(sq, group=pctx.mp_group)
    norm = math.sqrt(float(sq))
    if clip and norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))
    return norm


def optimizer_step(optimizer: torch.optim.Optimizer, pctx: Any, clip: float | None) -> float:
    """The one optimizer step of every trained model (SFT/RM/DPO trainers, the PPO actor, the
    critic): gradients summed over DP, clipped to the global norm over TP x PP, then the update.
    Returns the norm before clipping."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = reduce_gradients(params, pctx, clip)
    optimizer.step()
    return norm
