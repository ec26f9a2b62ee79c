"""A loss registered from a plugin module (tests/unit/losses/test_registry.py): one class and one
registration, with its own typed option. Run configs list this module under `plugins:`."""

from __future__ import annotations

from pydantic import Field

from slurm_align.config.base import StrictModel
from slurm_align.losses.base import Loss
from slurm_align.losses.registry import LossSpec, register_loss


class ScaledNLLOptions(StrictModel):
    scale: float = Field(1.0, gt=0)
    """Multiplies the response tokens' mean negative log-likelihood."""


class ScaledNLL(Loss):
    name = "toy_scaled_nll"
    options: ScaledNLLOptions

    def count(self, mb):
        return float(mb["mask"].sum())

    def __call__(self, output, mb):
        lp = self.token_logprobs(output, mb)
        mask = mb["mask"].to(lp.device)
        loss_sum = -(lp * mask).sum() * self.options.scale
        return loss_sum / mb["norm"], {"loss_sum": loss_sum.detach(), "tokens": mask.sum()}

    def metrics(self, s):
        return {"loss": float(s["loss_sum"] / s["tokens"].clamp(min=1))}


register_loss(LossSpec("toy_scaled_nll", "tests.support.toy_loss:ScaledNLL", ScaledNLLOptions))
