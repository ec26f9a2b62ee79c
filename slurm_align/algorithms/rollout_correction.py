"""Rollout correction: importance weights for the mismatch between the engine that sampled a
rollout and the trainer's policy at the start of the step.

Per response token t (mask m_t), with log pi_rollout the engine's log-prob of the token it sampled
(the 'rollout_logprobs' column) and log pi_old the trainer's recomputed one ('logprobs', before
this step's updates), delta_t = log pi_old(t) - log pi_rollout(t) and C = threshold:

    none               w_t = 1
    token_truncate     w_t = min(exp(delta_t), C)                                  (TIS)
    token_mask         w_t = exp(delta_t) if 1/C <= exp(delta_t) <= C, else 0
    sequence_truncate  w_t = min(exp(sum_t m_t delta_t), C) on every token of the sequence
    sequence_mask      g = exp(sum_t m_t delta_t / sum_t m_t); w_t = min(exp(delta_t), C) if
                       1/C <= g <= C, else 0 on the whole sequence

Both log-probs are of the same distribution: the model's at the run's sampling temperature,
before top-k/top-p (generation.params.logprob_temperature), so equal weights and an equal
forward give delta = 0 and w = 1 exactly. The weights are constants (computed without
gradient); policy_loss.clipped_policy_loss multiplies each token's surrogate term by its weight
before the configured aggregation (a masked token keeps its place in the denominator).

One registered function per mode (`register`); RunConfig.rollout_correction.mode names one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums, collective_device

WeightFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(delta [B, T], mask [B, T] float, threshold C) -> weights [B, T] (0 where mask is 0)."""

MODES: dict[str, WeightFn] = {}
"""The registered modes by name."""

WEIGHTS = "rollout_weights"
"""The per-token column `apply` sets (the policy loss reads it)."""


def register(name: str) -> Callable[[WeightFn], WeightFn]:
    """Register a weight function under `name` (the value of rollout_correction.mode)."""
    def deco(fn: WeightFn) -> WeightFn:
        if name in MODES:
            raise ValueError(f"rollout correction mode {name!r} is registered twice")
        MODES[name] = fn
        return fn
    return deco


@register("none")
def _none(delta: torch.Tensor, mask: torch.Tensor, C: float) -> torch.Tensor:
    return torch.ones_like(delta) * mask


@register("token_truncate")
def _token_truncate(delta: torch.Tensor, mask: torch.Tensor, C: float) -> torch.Tensor:
    return torch.exp(delta).clamp(max=C) * mask


@register("token_mask")
def _token_mask(delta: torch.Tensor, mask: torch.Tensor, C: float) -> torch.Tensor:
    r = torch.exp(delta)
    return torch.where((r >= 1.0 / C) & (r <= C), r, torch.zeros_like(r)) * mask


@register("sequence_truncate")
def _sequence_truncate(delta: torch.Tensor, mask: torch.Tensor, C: float) -> torch.Tensor:
    seq = torch.exp((delta * mask).sum(1)).clamp(max=C)
    return seq[:, None] * mask


@register("sequence_mask")
def _sequence_mask(delta: torch.Tensor, mask: torch.Tensor, C: float) -> torch.Tensor:
    g = torch.exp((delta * mask).sum(1) / mask.sum(1).clamp(min=1.0))
    keep = (g >= 1.0 / C) & (g <= C)
    return torch.where(keep[:, None], torch.exp(delta).clamp(max=C), torch.zeros_like(delta)) * mask


def weights(mode: str, logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
            threshold: float) -> torch.Tensor:
    """The correction weights [B, T] of `mode` (constants: no gradient flows through them)."""
    if mode not in MODES:
        raise ValueError(f"rollout_correction.mode {mode!r}: allowed {', '.join(MODES)}")
    with torch.no_grad():
        delta = logp_old.detach().double() - logp_rollout.detach().double()
        return MODES[mode](delta, mask.double(), float(threshold)).float()


def k3_kl(logp_old: torch.Tensor, logp_rollout: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_rollout || pi_old) from tokens sampled by pi_rollout:
    exp(delta) - delta - 1 with delta = log pi_old - log pi_rollout (>= 0, unbiased)."""
    delta = (logp_old - logp_rollout).double()
    return torch.exp(delta) - delta - 1.0


def _all_reduce_max(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        t = t.to(collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def apply(cfg, batch: RolloutBatch, dp_group) -> dict[str, float]:
    """Set the WEIGHTS column of this DP rank's shard for `cfg` (a RolloutCorrectionConfig) from
    its 'logprobs' and 'rollout_logprobs' columns, and return the step's metrics (over all DP
    ranks; collective): rollout_correction_{weight_mean, weight_max, zero_token_fraction,
    zero_sequence_fraction, kl_k3}. Without engine log-probs (NaN) mode 'none' sets weights 1
    and returns no metrics; another mode raises (on every rank alike)."""
    mask = batch.mask
    rollout = batch.per_token.get("rollout_logprobs")
    if rollout is None:
        rollout = torch.full_like(mask, float("nan"))
    missing = float((torch.isnan(rollout) & (mask > 0)).sum())
    total_missing = all_reduce_sums({"missing": missing}, dp_group)["missing"]
    if total_missing > 0:
        if cfg.mode != "none":
            raise RuntimeError(
                f"rollout_correction.mode={cfg.mode!r} needs the engine's log-probs, but {int(total_missing)} "
                "response tokens of this step have none (the engine returned no log-probs: TensorRT-LLM "
                "returns them only at temperature 1)")
        batch.set_tokens(WEIGHTS, mask.clone())
        return {}
    old = batch["logprobs"]
    w = weights(cfg.mode, old, rollout, mask, cfg.threshold)
    batch.set_tokens(WEIGHTS, w)
    has_tokens = mask.sum(1) > 0
    zero = (w == 0) & (mask > 0)
    s = all_reduce_sums({"w": (w * mask).double().sum(), "tokens": mask.sum(), "zero": zero.sum(),
                         "zero_seq": ((zero.sum(1) == mask.sum(1)) & has_tokens).sum(), "seqs": has_tokens.sum(),
                         "kl": (k3_kl(old, rollout) * mask).sum()}, dp_group)
    local_max = float((w * mask).max()) if mask.numel() and bool(has_tokens.any()) else -math.inf
    tokens, seqs = max(s["tokens"], 1.0), max(s["seqs"], 1.0)
    return {"rollout_correction_weight_mean": s["w"] / tokens,
            "rollout_correction_weight_max": _all_reduce_max(local_max, dp_group),
            "rollout_correction_zero_token_fraction": s["zero"] / tokens,
            "rollout_correction_zero_sequence_fraction": s["zero_seq"] / seqs,
            "rollout_correction_kl_k3": s["kl"] / tokens}
