"""PPO's numerics as NeMo-Aligner defines them: KL-penalised rewards, GAE, whitening, the loss.

Shapes: per-token tensors are [B, T] over RESPONSE tokens (position t = t-th generated token),
`mask` is 1 for real response tokens and 0 for padding. The critic's clipped value loss lives
in slurm_align.critic.loss (the critic trains it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slurm_align.algorithms.rollout_batch import all_reduce_sums


def kl_penalized_rewards(score: torch.Tensor, logp: torch.Tensor, logp_ref: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token reward: -kl_coef * (logp - logp_ref), plus the reward model's score at the last
    response token of each sample."""
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


@dataclass
class PolicyLossStats:
    loss: float
    ppo_ratio: float
    ppo_ratio_clamped: float   # fraction of tokens where the clip was active
    entropy: float


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, is_end: torch.Tensor, clip: float,
                    entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                    token_count: float | None = None) -> tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate averaged over the tokens of responses that ended properly (is_end).

    `token_count` (the global count over DP ranks and micro-batches) turns the mean into a
    share of the global mean, so gradients summed over DP ranks equal the global mean's.
    """
    m = mask * is_end.to(mask.dtype)[:, None]
    n = float(m.sum()) if token_count is None else token_count
    n = max(n, 1.0)
    ratio = torch.exp(logp - old_logp)
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    per_token = -torch.minimum(surr1, surr2)
    loss = (per_token * m).sum() / n
    ent_value = 0.0
    if entropy is not None:
        ent = (entropy * m).sum() / n
        loss = loss - entropy_coef * ent
        ent_value = float(ent)
    with torch.no_grad():
        local = max(float(m.sum()), 1.0)
        clamped = ((surr2 < surr1).to(m.dtype) * m).sum() / local
        stats = PolicyLossStats(float(loss), float((ratio * m).sum() / local), float(clamped), ent_value)
    return loss, stats
