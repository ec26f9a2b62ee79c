"""Advantage estimators of the PPO family, in one place: the formulas, and each estimator as one
registered function that the actor loop (policy_gradient.estimate_advantages) calls once a step.

Shapes: per-token tensors are [B, T] over RESPONSE tokens with `mask` 1 on the model's tokens (0 on
padding, and inside a multi-turn trajectory on the environment's tokens); per-sample tensors are
[B]. A group is the set of samples drawn for one prompt (`n_samples_per_prompt`); `groups` gives
each sample's group id (any integers; groups may differ in size).

| estimator      | needs a value model | baseline                       | normalisation               |
|----------------|---------------------|--------------------------------|-----------------------------|
| `gae`          | yes                 | the critic's values            | whitened over the batch     |
| `grpo`         | no                  | the group's mean reward        | / group std (optional)      |
| `rloo`         | no                  | mean of the group's OTHER ones | none                        |
| `reinforce_pp` | no                  | none (return-to-go with KL)    | whitened over the batch     |

GRPO without the std division is Dr. GRPO (Liu et al., 2025). A group of one has no baseline
to compare with: GRPO and RLOO give it advantage 0 (it carries no learning signal), as they do a
group whose rewards are all equal; `equal_reward_groups` finds those for dynamic sampling (DAPO).

A new estimator is one `@register_estimator("name")` function (run, batch, dp_group, kl_coef) ->
(advantages, returns), named by an AlgorithmSpec (config/algorithms.py); tests/support/toy_algorithm.py
registers one from outside the library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slurm_align.algorithms.rollout_batch import RolloutBatch, all_reduce_sums


# -- the formulas ----------------------------------------------------------------------------
def kl_penalized_rewards(score: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token reward: -kl_coef * (logp - logp_ref), plus the sample's score at its last
    response token (NeMo-Aligner's PPO reward)."""
    rewards = -kl_coef * (logp - logp_ref) * mask
    has_tokens = mask.sum(dim=1) > 0
    # the last masked token (a multi-turn mask has holes where the environment's tokens are)
    last = mask.shape[1] - 1 - (mask.flip(1) > 0).to(torch.int64).argmax(dim=1)
    rows = torch.arange(score.shape[0])[has_tokens]
    rewards[rows, last[has_tokens]] += score[has_tokens].to(rewards.dtype)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, next value 0 after each sample's last token.

    Positions where mask is 0 are skipped: after the end (padding), and inside a multi-turn
    trajectory (the environment's tokens), so the model's turns chain across them.
    Returns (advantages, returns), both zero where mask is 0; returns = advantages + values.
    """
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    last_gae = torch.zeros(B, dtype=rewards.dtype)
    next_value = torch.zeros(B, dtype=rewards.dtype)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m > 0, delta + gamma * lam * last_gae, last_gae)
        adv[:, t] = last_gae * m
        # Padding after the end keeps "next value 0" for the last real token.
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (adv + values) * mask
    return adv, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None,
                  shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std with the masked mean and variance taken over ALL data-parallel ranks."""
    sums = all_reduce_sums({"total": (x * mask).sum(), "total_sq": (x * x * mask).sum(), "count": mask.sum()},
                           group)
    total, total_sq, count = sums["total"], sums["total_sq"], sums["count"]
    if count == 0:
        return torch.zeros_like(x)
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    out = (x - mean) * (var + eps) ** -0.5
    if not shift_mean:
        out = out + mean
    return out * mask


def group_stats(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's size, sum of rewards and sum of squared rewards ([B] each, float64)."""
    _, inv = torch.unique(groups, return_inverse=True)
    x = scores.double()
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    size = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(x))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, x)
    total_sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inv, x * x)
    return size[inv], total[inv], total_sq[inv]


def grpo(scores: torch.Tensor, groups: torch.Tensor, *, normalize_std: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al., 2024): A_i = (r_i - mean(group)) / (std(group) + eps), std with Bessel's
    correction (n - 1) as TRL and veRL take it. normalize_std=False gives Dr. GRPO's
    A_i = r_i - mean(group). All-equal groups and groups of one get exactly 0. [B] -> [B]."""
    size, total, total_sq = group_stats(scores, groups)
    mean = total / size
    adv = scores.double() - mean
    if normalize_std:
        var = ((total_sq - size * mean * mean) / (size - 1).clamp(min=1)).clamp(min=0)
        adv = adv / (var.sqrt() + eps)
    adv = torch.where(size > 1, adv, torch.zeros_like(adv))
    return adv.to(scores.dtype)


def rloo(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024): A_i = r_i - mean of the group's other rewards
    = n / (n - 1) * (r_i - mean(group)). Groups of one get 0. [B] -> [B]."""
    size, total, _ = group_stats(scores, groups)
    x = scores.double()
    others = (total - x) / (size - 1).clamp(min=1)
    adv = torch.where(size > 1, x - others, torch.zeros_like(x))
    return adv.to(scores.dtype)


def reinforce_pp(scores: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                 kl_coef: float, *, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): per-token reward -kl_coef * (logp - logp_ref) with the score on the
    last token, return-to-go G_t = sum_{s>=t} r_s (no discount, no critic). Returns (advantages,
    returns): the returns whitened over the whole batch (masked mean and variance over every DP
    rank in `group`), and the returns themselves. [B, T] each."""
    rewards = kl_penalized_rewards(scores, logp, logp_ref, mask, kl_coef)
    returns = rewards.flip(1).cumsum(1).flip(1) * mask
    return masked_whiten(returns, mask, group), returns


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage [B] on every response token of its sample: [B, T]."""
    return advantages.to(mask.dtype)[:, None] * mask


def equal_reward_groups(scores: torch.Tensor, groups: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Dynamic sampling's filter (DAPO): True for samples whose group has all rewards equal (within
    atol), including groups of one. Their group advantage is 0 and they only dilute the batch."""
    _, inv = torch.unique(groups, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    x = scores.double()
    hi = torch.full((n,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, x, "amax")
    lo = torch.full((n,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, x, "amin")
    return (hi - lo)[inv] <= atol


# -- the registered estimators ---------------------------------------------------------------
Estimator = Callable[[Any, RolloutBatch, Any, float], "tuple[torch.Tensor, torch.Tensor]"]
"""(run, batch, dp_group, kl_coef) -> (advantages, returns), both [B, T] over response tokens.
kl_coef is ppo.kl_coef when the KL sits in the reward, else 0. The batch has the columns reward,
group, logprobs, ref_logprobs (NaN without a KL penalty) and, for a value model, values."""

ESTIMATORS: dict[str, Estimator] = {}
"""Advantage estimators by the name an AlgorithmSpec gives (config/algorithms.py)."""


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    def deco(fn: Estimator) -> Estimator:
        if name in ESTIMATORS and ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ESTIMATORS[name] = fn
        return fn
    return deco


def estimator(name: str) -> Estimator:
    """The registered estimator `name` (ValueError listing the registered ones otherwise)."""
    if name not in ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is not registered (registered: {', '.join(ESTIMATORS)}; "
                         "see register_estimator)")
    return ESTIMATORS[name]


def _reference(batch: RolloutBatch, kl_coef: float) -> torch.Tensor:
    # Without a KL penalty the reference pass is skipped (its column is NaN, and 0 * NaN is NaN):
    # the policy's own log-probs make the penalty the 0 it is.
    return batch["ref_logprobs"] if kl_coef > 0 else batch["logprobs"]


@register_estimator("gae")
def _gae(run, batch: RolloutBatch, dp_group, kl_coef: float):
    mask = batch.mask
    rewards = kl_penalized_rewards(batch["reward"].float(), batch["logprobs"], _reference(batch, kl_coef),
                                   mask, kl_coef)
    adv, returns = gae(rewards, batch["values"], mask, run.ppo.gamma, run.ppo.lam)
    return masked_whiten(adv, mask, dp_group), returns


@register_estimator("reinforce_pp")
def _reinforce_pp(run, batch: RolloutBatch, dp_group, kl_coef: float):
    return reinforce_pp(batch["reward"].float(), batch["logprobs"], _reference(batch, kl_coef), batch.mask,
                        kl_coef, group=dp_group)


def _sequence_returns(batch: RolloutBatch, kl_coef: float) -> torch.Tensor:
    # With the KL in the reward, a sample's return is its score minus its summed KL penalty.
    return batch["reward"].float() - kl_coef * ((batch["logprobs"] - _reference(batch, kl_coef)) * batch.mask).sum(1)


@register_estimator("grpo")
def _grpo(run, batch: RolloutBatch, dp_group, kl_coef: float):
    seq = _sequence_returns(batch, kl_coef)
    adv = grpo(seq, batch["group"], normalize_std=run.rl.normalize_group_std)
    return per_token(adv, batch.mask), per_token(seq, batch.mask)


@register_estimator("rloo")
def _rloo(run, batch: RolloutBatch, dp_group, kl_coef: float):
    seq = _sequence_returns(batch, kl_coef)
    return per_token(rloo(seq, batch["group"]), batch.mask), per_token(seq, batch.mask)
