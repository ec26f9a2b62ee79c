"""Rejection sampling (as NeMo-Aligner has it): draw n samples per prompt, keep the best by
reward, fine-tune on the kept ones with the SFT loss, repeat with the improved policy.

In the actor loop it differs from the policy-gradient estimators only in what it trains on:
`keep_best` marks the best sample of each group (the 'train' weight), and the update is PolicyUpdate's
'sft' loss (negative log-likelihood of the kept responses).
"""

from __future__ import annotations

import torch

from slurm_align.algorithms.advantages import equal_reward_groups
from slurm_align.algorithms.rollout_batch import RolloutBatch


def best_of_groups(scores: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[B] float: 1 for the highest-scoring sample of each group (ties: the first one), else 0.
    A group whose rewards are all equal has no best sample (with a 0/1 verifiable reward: all
    wrong, or all right already): nothing is kept from it."""
    keep = torch.zeros(scores.shape[0])
    undecided = equal_reward_groups(scores, groups)
    for g in torch.unique(groups):
        rows = torch.nonzero(groups == g).flatten()
        if not bool(undecided[rows[0]]):
            keep[rows[int(torch.argmax(scores[rows]))]] = 1.0
    return keep


def keep_best(batch: RolloutBatch) -> dict[str, float]:
    """Set the 'train' weight to the best sample of each group; advantages, returns and values
    are 0 (stored for the record; the SFT update does not read them). Returns metrics: the mean
    reward of the kept samples (summed over this rank; the caller reduces)."""
    keep = best_of_groups(batch["reward"].float(), batch["group"])
    zeros = torch.zeros_like(batch.mask)
    for name in ("advantages", "returns", "values"):
        batch.set_tokens(name, zeros)
    batch.set_samples("train", keep)
    return {"kept_reward_sum": float((batch["reward"].float() * keep).sum()), "kept": float(keep.sum())}
