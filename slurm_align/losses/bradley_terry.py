"""Reward model, Bradley-Terry: -log sigma(reward(chosen) - reward(rejected)), the reward being
the value head at each sequence's last token."""

from __future__ import annotations

import torch.nn.functional as F

from slurm_align.losses.base import Loss
from slurm_align.models.forward import last_token_values, per_sequence


class BradleyTerry(Loss):
    name = "bradley_terry"
    pairs = True
    value_head = True

    def __call__(self, output, mb):
        rewards = last_token_values(per_sequence(output, mb), mb["lengths"])
        rc, rr = rewards.chunk(2)
        diff = rc - rr
        real = mb["real"].to(diff.device)
        loss_sum = -(F.logsigmoid(diff) * real).sum()
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "correct": ((diff > 0).float() * real).sum(),
            "pairs": real.sum(), "margin_sum": (diff.detach() * real).sum()}

    def metrics(self, s):
        n = s["pairs"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "accuracy": float(s["correct"] / n),
                "reward_margin": float(s["margin_sum"] / n)}
