"""The policy loss of the PPO family: clipped surrogate with asymmetric clipping (DAPO), a KL loss
term with the k1/k2/k3 estimators, and the three ways to aggregate per-token losses.

Shapes: [B, T] over response tokens, `mask` 1 on tokens that count. Every aggregation divides
by a DENOMINATOR the caller may give as the global count (tokens or sequences over all DP ranks
and micro-batches): then each rank's loss is its share of the global mean, and gradients summed
over DP ranks equal the global mean's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators), with
    d = logp_ref - logp:  k1 = -d (unbiased, can be negative), k2 = d^2 / 2 (low variance,
    biased), k3 = exp(d) - d - 1 (unbiased and >= 0; GRPO's choice)."""
    d = logp_ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        # clamp keeps exp finite when the two policies disagree wildly on a token
        return torch.exp(d.clamp(max=20.0)) - d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: k1, k2, k3")


def denominator(mask: torch.Tensor, agg: LossAgg) -> float:
    """The local count an aggregation divides by: tokens (token-mean) or sequences with at least
    one counted token (seq-mean-*). Sum it over DP ranks for the global mean."""
    if agg == "token-mean":
        return float(mask.sum())
    return float((mask.sum(1) > 0).sum())


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: LossAgg, norm: float | None = None) -> torch.Tensor:
    """token-mean: sum over all tokens / token count (long answers weigh more; DAPO, Dr. GRPO);
    seq-mean-token-mean: mean over sequences of each one's token mean (GRPO as published);
    seq-mean-token-sum: mean over sequences of each one's token sum (no length normalisation).
    `norm`: the denominator (default: this batch's own, `denominator(mask, agg)`)."""
    n = max(denominator(mask, agg) if norm is None else norm, 1.0)
    masked = per_token * mask
    if agg == "token-mean":
        return masked.sum() / n
    if agg == "seq-mean-token-mean":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / n
    if agg == "seq-mean-token-sum":
        return masked.sum() / n
    raise ValueError(f"unknown loss aggregation {agg!r}; allowed: token-mean, seq-mean-token-mean, "
                     "seq-mean-token-sum")


@dataclass
class LossTerms:
    """How the policy loss is built (from RunConfig.ppo / rl)."""

    eps_low: float = 0.2
    """Clip the ratio below at 1 - eps_low."""
    eps_high: float = 0.2
    """Clip the ratio above at 1 + eps_high (DAPO's clip-higher: eps_high > eps_low)."""
    agg: LossAgg = "token-mean"
    """Aggregation of per-token losses."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss term (0: none; the KL may sit in the reward instead)."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of the KL loss term."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""


@dataclass
class PolicyLossStats:
    """Token-weighted means over the counted tokens of this call (for metrics)."""

    loss: float
    ratio: float
    clipped_fraction: float   # tokens where the clip took the gradient away
    kl: float                 # the KL estimator's mean (0 when kl_loss_coef is 0)
    entropy: float
    tokens: float


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, terms: LossTerms, *, ref_logp: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None, norm: float | None = None,
                        weights: torch.Tensor | None = None,
                        options: Any = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """-w min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, r = exp(logp - old_logp),
    w the rollout-correction weight (constant; 1 without `weights`), aggregated by `terms.agg`
    (a token with w = 0 still counts in the denominator); plus kl_loss_coef * KL(pi || ref) and
    minus entropy_coef * entropy, aggregated the same way. The registered policy loss
    'ppo_clip' (losses/registry.py); `options`: its (empty) loss options, as every registered
    policy loss takes them."""
    ratio = torch.exp(logp - old_logp)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - terms.eps_low, 1.0 + terms.eps_high) * advantages
    per_token = -torch.minimum(surr1, surr2)
    if weights is not None:
        per_token = per_token * weights.detach()
    kl = None
    if terms.kl_loss_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_loss_coef > 0 needs the reference log-probs (ref_logp)")
        kl = kl_penalty(logp, ref_logp, terms.kl_estimator)
        per_token = per_token + terms.kl_loss_coef * kl
    if entropy is not None and terms.entropy_coef > 0:
        per_token = per_token - terms.entropy_coef * entropy
    loss = aggregate(per_token, mask, terms.agg, norm)
    with torch.no_grad():
        n = max(float(mask.sum()), 1.0)
        mean = lambda t: float((t * mask).sum() / n)  # noqa: E731
        stats = PolicyLossStats(float(loss), mean(ratio), mean((surr2 < surr1).to(mask.dtype)),
                                mean(kl) if kl is not None else 0.0,
                                mean(entropy) if entropy is not None else 0.0, float(mask.sum()))
    return loss, stats
