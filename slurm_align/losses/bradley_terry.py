"""Reward model, Bradley-Terry: -log sigma(reward(chosen) - reward(rejected) - margin), the
reward being the value head at each sequence's last token and the margin that of rows carrying
chosen_reward / rejected_reward (losses/registry.py BradleyTerryOptions; 0 otherwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slurm_align.losses.base import Loss
from slurm_align.losses.registry import BradleyTerryOptions
from slurm_align.models.forward import last_token_values, per_sequence


class BradleyTerry(Loss):
    name = "bradley_terry"
    pairs = True
    value_head = True
    columns = ("tokens", "lengths", "mask", "real", "rewards")

    options: BradleyTerryOptions

    def __call__(self, output, mb):
        rewards = last_token_values(per_sequence(output, mb), mb["lengths"])
        rc, rr = rewards.chunk(2)
        diff = rc - rr
        real = mb["real"].to(diff.device)
        given_c, given_r = mb["rewards"].chunk(2)
        margin = torch.nan_to_num(given_c - given_r, nan=0.0).to(diff) * self.options.margin_scale
        loss_sum = -(F.logsigmoid(diff - margin) * real).sum()
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "correct": ((diff > 0).float() * real).sum(),
            "pairs": real.sum(), "margin_sum": (diff.detach() * real).sum()}

    def metrics(self, s):
        n = s["pairs"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "accuracy": float(s["correct"] / n),
                "reward_margin": float(s["margin_sum"] / n)}
