"""GSPO (Zheng et al. 2025, sequence-level importance ratio) registered from a plugin module as
the RL actor's policy loss: one function and one registration, with its own typed options, no
library edit. Runs list this module under `plugins:` and set `loss: {name: toy_gspo}`.

Per sequence, s = exp(mean over its response tokens of (log pi - log pi_old)); GSPO-token's
per-token ratio s_t = sg(s) * pi(y_t) / sg(pi(y_t)) (the value of s, the gradient of each
token); loss = -min(s_t A, clip(s_t, 1 - eps_low, 1 + eps_high) A), averaged per sequence, then
over sequences (normaliser `norm` when given)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from slurm_align.algorithms.policy_loss import PolicyLossStats
from slurm_align.config.base import StrictModel
from slurm_align.losses.registry import LossSpec, register_loss

CALLS: list[float] = []
"""The sequence-level ratio's mean of every call (what a test checks the actor used)."""


class GSPOOptions(StrictModel):
    eps_low: float = Field(3e-4, gt=0, lt=1)
    """Clip below at 1 - eps_low (GSPO clips the sequence ratio much tighter than PPO the token's)."""
    eps_high: float = Field(4e-4, gt=0)
    """Clip above at 1 + eps_high."""


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, terms: Any,
              *, ref_logp=None, entropy=None, norm: float | None = None, weights=None,
              options: GSPOOptions) -> tuple[torch.Tensor, PolicyLossStats]:
    n_tok = mask.sum(1).clamp(min=1)
    seq_log_ratio = ((logp - old_logp) * mask).sum(1) / n_tok
    s = torch.exp(seq_log_ratio.detach())[:, None] * torch.exp(logp - logp.detach())
    clipped = s.clamp(1 - options.eps_low, 1 + options.eps_high)
    per_token = -torch.minimum(s * advantages, clipped * advantages)
    seqs = (mask.sum(1) > 0).float()
    loss = ((per_token * mask).sum(1) / n_tok * seqs).sum() / max(norm if norm is not None else float(seqs.sum()), 1.0)
    with torch.no_grad():
        tokens = float(mask.sum())
        ratio = float((s * mask).sum() / max(tokens, 1.0))
        CALLS.append(float(torch.exp(seq_log_ratio).mean()))
        frac = float((((clipped * advantages) < (s * advantages)).float() * mask).sum() / max(tokens, 1.0))
    return loss, PolicyLossStats(float(loss), ratio, frac, 0.0, 0.0, tokens)


register_loss(LossSpec("toy_gspo", "tests.support.gspo_loss:gspo_loss", GSPOOptions, kind="policy"))
