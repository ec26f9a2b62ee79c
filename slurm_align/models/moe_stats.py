"""Router statistics of a mixture-of-experts model for the metrics: per-expert load and the
load-balancing loss, over every MoE layer, micro-batch and rank since the last `collect()`.

Per-expert load comes from a forward hook on each megatron TopKRouter (its routing map: which
experts each token went to), so it is counted whether or not the aux loss is on. The
load-balancing loss is the Switch loss megatron's routers record (unscaled by the
coefficient) in megatron's aux-loss tracker, which only holds values when
model.moe_aux_loss_coeff > 0.

`collect()` is collective over the model's world (every rank calls it; counts are summed over
DP, PP and EP ranks) and returns:
- moe/expert_load_<e>: the share of routed tokens that went to expert e (summed over layers);
- moe/load_max_over_mean: the busiest expert's load over the mean load (1 = balanced);
- moe/aux_loss: the mean load-balancing loss per MoE layer and micro-batch (aux loss on only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


class RouterStats:
    """Counts per-expert tokens of every router in `chunks` (forward hooks) until `collect()`."""

    def __init__(self, chunks: list, num_experts: int):
        self.num_experts = num_experts
        self.counts = torch.zeros(num_experts, dtype=torch.float64)
        self.calls = 0   # router forwards (layers x micro-batches): the aux loss's denominator
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self._hooks = [r.register_forward_hook(self._count) for r in self.routers]

    def _count(self, module, inputs, output) -> None:
        _, routing_map = output   # [tokens, experts]: True where a token was sent
        self.counts += routing_map.detach().double().sum(0).cpu()
        self.calls += 1

    def reset(self) -> None:
        """Forget what was counted so far (local: no communication), e.g. the PPO actor's
        log-prob passes before its update."""
        self.counts.zero_()
        self.calls = 0
        moe_utils.clear_aux_losses_tracker()

    @torch.no_grad()
    def collect(self, group: Any = None) -> dict[str, float]:
        """The statistics since the last collect (then reset); collective over `group`
        (default: the whole world)."""
        tracker = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = tracker["values"].detach().double().cpu() if tracker is not None else None
        vec = torch.cat([self.counts, torch.tensor([float(self.calls)]),
                         aux.sum().reshape(1) if aux is not None else torch.zeros(1)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(vec, group=group)
        counts, calls, aux_sum = vec[: self.num_experts], float(vec[-2]), float(vec[-1])
        self.reset()
        total = float(counts.sum())
        out: dict[str, float] = {}
        if total > 0:
            share = counts / total
            out.update({f"moe/expert_load_{e}": float(s) for e, s in enumerate(share)})
            out["moe/load_max_over_mean"] = float(share.max() * self.num_experts)
        if aux is not None and calls > 0:
            out["moe/aux_loss"] = aux_sum / calls
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
