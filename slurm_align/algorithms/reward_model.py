"""Reward model: Bradley-Terry on (chosen, rejected); the reward is the value head at each
sequence's last token."""

from __future__ import annotations

import torch.nn.functional as F

from slurm_align.data.datasets import PreferenceDataset
from slurm_align.models.forward import last_token_values, per_sequence


class RewardModel:
    name = "rm"
    value_head = True
    pairs = True

    def __init__(self, run):
        pass

    def dataset(self, path, tok, max_len, columns=None):
        return PreferenceDataset(path, tok, max_len, columns)

    def local_norm(self, microbatches) -> float:
        return float(sum(mb["real"].sum() for mb in microbatches))  # pairs (filler pairs: real 0)

    def setup(self, trainer) -> None:
        pass

    def prepare(self, trainer, microbatches) -> None:
        pass

    def loss(self, output, mb):
        rewards = last_token_values(per_sequence(output, mb), mb["lengths"])
        rc, rr = rewards.chunk(2)
        diff = rc - rr
        real = mb["real"].to(diff.device)
        loss_sum = -(F.logsigmoid(diff) * real).sum()
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "correct": ((diff > 0).float() * real).sum(),
            "pairs": real.sum(), "margin_sum": (diff.detach() * real).sum()}

    @staticmethod
    def metrics(s: dict) -> dict:
        n = s["pairs"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "accuracy": float(s["correct"] / n),
                "reward_margin": float(s["margin_sum"] / n)}
