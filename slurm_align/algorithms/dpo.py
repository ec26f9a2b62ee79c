"""DPO: -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))).

The frozen reference is the initial policy, kept in host memory by HostSwap and swapped into
the same model for its forward pass (no second model on the device); for a LoRA model it is
the same model with its adapters off (models/lora.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slurm_align.data.datasets import PreferenceDataset
from slurm_align.models.forward import run_schedule, sequence_token_logprobs
from slurm_align.models.lora import AdaptersOff, reference_policy
from slurm_align.models.weights import HostSwap


class DPO:
    name = "dpo"
    value_head = False
    pairs = True

    def __init__(self, run):
        self.vocab_size = run.model.vocab_size
        self.beta = run.trainer.dpo_beta
        self.reference: HostSwap | AdaptersOff | None = None   # AdaptersOff for a LoRA model

    def dataset(self, path, tok, max_len, columns=None):
        return PreferenceDataset(path, tok, max_len, columns)

    def local_norm(self, microbatches) -> float:
        return float(sum(mb["real"].sum() for mb in microbatches))   # pairs (filler pairs: real 0)

    def _sequence_logprobs(self, output, mb) -> torch.Tensor:
        """Sum of response-token log-probs per sequence [b] (padded or packed micro-batch)."""
        return (sequence_token_logprobs(output, mb, self.vocab_size) * mb["mask"].to(output.device)).sum(-1)

    def setup(self, trainer) -> None:
        # Called after the init checkpoint is loaded and before any resume: the reference is
        # the initial policy.
        self.reference = reference_policy(trainer.chunks)

    @torch.no_grad()
    def prepare(self, trainer, microbatches) -> None:
        """Reference log-probs of every micro-batch (last stage), computed with the reference
        weights swapped in."""
        def ref_loss(output, mb):
            return output.new_zeros(()), {"ref": self._sequence_logprobs(output, mb)}
        assert self.reference is not None, "setup() first"
        self.reference.swap()
        try:
            infos = run_schedule(trainer.chunks, microbatches, ref_loss, forward_only=True)
        finally:
            self.reference.swap()
        for mb, info in zip(microbatches, infos):
            mb["ref"] = info["ref"]

    def loss(self, output, mb):
        pol = self._sequence_logprobs(output, mb)
        ref = mb["ref"].to(pol.device)
        pc, pr = pol.chunk(2)
        rc, rr = ref.chunk(2)
        margin = self.beta * ((pc - rc) - (pr - rr))
        real = mb["real"].to(margin.device)
        loss_sum = -(F.logsigmoid(margin) * real).sum()
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "margin_sum": (margin.detach() * real).sum(),
            "correct": ((margin > 0).float() * real).sum(), "pairs": real.sum(),
            "chosen_reward_sum": (self.beta * (pc - rc) * real).detach().sum()}

    @staticmethod
    def metrics(s: dict) -> dict:
        n = s["pairs"].clamp(min=1)
        return {"loss": float(s["loss_sum"] / n), "reward_margin": float(s["margin_sum"] / n),
                "accuracy": float(s["correct"] / n), "chosen_reward": float(s["chosen_reward_sum"] / n)}
