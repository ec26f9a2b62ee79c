"""The PPO critic's clipped value loss (as in NeMo-Aligner), trained through the model worker's
step (critic/worker.py): 0.5 * max((clip(v, v_old +- value_clip) - R)^2, (v - R)^2) at every
masked position, averaged over the masked positions of the whole batch (all DP ranks)."""

from __future__ import annotations

from typing import Any, ClassVar

from slurm_align.critic.loss import clipped_value_loss_sum
from slurm_align.losses.base import Loss
from slurm_align.models.forward import per_sequence


class ValueLoss(Loss):
    name = "value"
    value_head = True
    columns: ClassVar[tuple[str, ...]] = ("tokens", "returns", "prev", "mask")
    """Per position [b, s]: the returns R, the values v_old the rollouts were scored with, the
    positions that count (critic/worker.ValueTargets)."""
    sum_keys: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, options: Any, model: Any = None):
        self.options, self.vocab_size = options, None

    def count(self, mb):
        return float(mb["mask"].sum())

    def __call__(self, values, mb):
        loss = clipped_value_loss_sum(per_sequence(values.float(), mb), mb["prev"], mb["returns"], mb["mask"],
                                      self.options.value_clip) / mb["norm"]
        return loss, {"loss": loss.detach()}

    def metrics(self, s):
        return {"loss": float(s["loss"])}
