"""Rotary position embeddings as megatron-core and transformers compute them (float32).

inv_freq = 1 / base^(2i/d), optionally Llama-3 scaled (transformers' _compute_llama3_parameters,
which megatron's RotaryEmbedding._apply_scaling mirrors); the angle of position p is p * inv_freq,
repeated for both halves of the head (non-interleaved, "rotate half"), so
rope(x) = x * cos + rotate_half(x) * sin.
"""

from __future__ import annotations

import math

import torch


def inv_freq(head_dim: int, base: float, scaling=None) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies; `scaling` is a RopeScalingConfig or None."""
    freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*positions.shape, head_dim] of int positions (computed per call, as megatron
    does: a table over max_seq_len would be large for long-context models)."""
    angles = positions.to(freq.dtype).unsqueeze(-1) * freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated; cos/sin broadcast against x (gathered per position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
