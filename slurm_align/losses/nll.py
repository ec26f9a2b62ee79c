"""Supervised fine-tuning: next-token negative log-likelihood of the response tokens, averaged
over every response token of the global batch."""

from __future__ import annotations

from slurm_align.losses.base import Loss


class NLL(Loss):
    name = "nll"

    def count(self, mb):
        return float(mb["mask"].sum())   # response tokens (filler samples have mask 0)

    def __call__(self, output, mb):
        lp = self.token_logprobs(output, mb)
        mask = mb["mask"].to(lp.device)
        loss_sum = -(lp * mask).sum()
        return loss_sum / mb["norm"], {"loss_sum": loss_sum.detach(), "tokens": mask.sum()}

    def metrics(self, s):
        return {"loss": float(s["loss_sum"] / s["tokens"].clamp(min=1))}
