"""Advantage estimators of the PPO family, each a named function with its formula.

Shapes: per-token tensors are [B, T] over RESPONSE tokens with `mask` 1 on real tokens; per-sample
tensors are [B]. A group is the set of samples drawn for one prompt (`n_samples_per_prompt`);
`groups` gives each sample's group id (any integers; groups may differ in size).

| estimator      | needs a value model | baseline                       | normalisation               |
|----------------|---------------------|--------------------------------|-----------------------------|
| `gae`          | yes                 | the critic's values            | whitened over the batch     |
| `grpo`         | no                  | the group's mean reward        | / group std (optional)      |
| `rloo`         | no                  | mean of the group's OTHER ones | none                        |
| `reinforce_pp` | no                  | none (return-to-go with KL)    | whitened over the batch     |

GRPO without the std division is Dr. GRPO (Liu et al., 2025). A group of one has no baseline
to compare with: GRPO and RLOO give it advantage 0 (it carries no learning signal), as they do a
group whose rewards are all equal; `equal_reward_groups` finds those for dynamic sampling (DAPO).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from slurm_align.algorithms.ppo_math import gae, kl_penalized_rewards, masked_whiten

Estimator = Literal["gae", "grpo", "rloo", "reinforce_pp"]
NEEDS_VALUES: dict[str, bool] = {"gae": True, "grpo": False, "rloo": False, "reinforce_pp": False}
"""Whether the estimator needs the critic's value model (only GAE does)."""

__all__ = ["gae", "grpo", "rloo", "reinforce_pp", "equal_reward_groups", "per_token", "group_stats"]


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
                 kl_coef: float, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """REINFORCE++ (Hu, 2025): per-token reward -kl_coef * (logp - logp_ref) with the score on the
    last token, return-to-go G_t = sum_{s>=t} r_s (no discount, no critic), then whitened over the
    whole batch (masked mean and variance over every DP rank in `group`). [B, T] -> [B, T]."""
    rewards = kl_penalized_rewards(scores, logp, logp_ref, mask, kl_coef)
    returns = rewards.flip(1).cumsum(1).flip(1) * mask
    return masked_whiten(returns, mask, group)


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
