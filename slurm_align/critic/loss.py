"""The clipped value loss (PPO critic, as in NeMo-Aligner)."""

from __future__ import annotations

import torch


def clipped_value_loss_sum(values: torch.Tensor, prev_values: torch.Tensor, returns: torch.Tensor,
                           mask: torch.Tensor, clip: float) -> torch.Tensor:
    """Sum over masked positions of 0.5 * max((clip(v, v_old +- clip) - R)^2, (v - R)^2).

    A sum (not a mean) so that data-parallel ranks can add their parts and divide by the
    global mask count themselves.
    """
    clipped = prev_values + (values - prev_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    return (per_token * mask).sum()


def clipped_value_loss(values, prev_values, returns, mask, clip: float) -> torch.Tensor:
    """Masked mean of the clipped value loss over one batch."""
    return clipped_value_loss_sum(values, prev_values, returns, mask, clip) / mask.sum().clamp_min(1.0)
