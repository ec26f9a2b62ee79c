"""The mapping between sequence positions and response tokens, for a batch of prompt + response
sequences (prompt_lengths with BOS, response_lengths): used by the rollout batch
(algorithms/rollout_batch.py) and by the datasets that train on responses (data/datasets.py).

Response token t of sample i is sequence position p_i + t (p_i its prompt length); the model
output that predicts it (its next-token log-prob, and the critic's value of the state before it,
as in NeMo-Aligner) sits at sequence position p_i + t - 1.
"""

from __future__ import annotations

import torch


def response_positions(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, T: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence position whose output predicts response token t ([B, T] int64), and the mask of
    real response tokens ([B, T] float)."""
    t = torch.arange(T).unsqueeze(0)
    mask = (t < response_lengths.unsqueeze(1)).float()
    pos = (prompt_lengths.unsqueeze(1) - 1 + t).clamp(min=0)
    return pos, mask


def gather_response(per_position: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                    T: int) -> torch.Tensor:
    """[B, W] values over sequence positions (next-token log-probs [B, L-1], critic values
    [B, L]) -> [B, T] over response tokens, 0 past each response's end."""
    pos, mask = response_positions(prompt_lengths, response_lengths, T)
    pos, mask = pos.to(per_position.device), mask.to(per_position.device)
    return per_position.gather(1, pos.clamp(max=per_position.shape[1] - 1)) * mask


def position_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float: 1 at the sequence positions that predict a response token."""
    col = torch.arange(width).unsqueeze(0)
    start = prompt_lengths.unsqueeze(1) - 1
    return ((col >= start) & (col < start + response_lengths.unsqueeze(1))).float()


def scatter_positions(per_token: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                      width: int) -> torch.Tensor:
    """Inverse of gather_response: [B, T] over response tokens -> [B, width], 0 elsewhere."""
    pos, mask = response_positions(prompt_lengths, response_lengths, per_token.shape[1])
    out = torch.zeros(per_token.shape[0], width + per_token.shape[1], dtype=per_token.dtype)
    # Padding columns (mask 0) write zeros past `width`, into a margin that is cut off.
    pos = torch.where(mask.bool(), pos, width + torch.arange(per_token.shape[1]).unsqueeze(0))
    out.scatter_(1, pos, per_token * mask.to(per_token.dtype))
    return out[:, :width]
