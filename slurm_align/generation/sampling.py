"""Token selection: greedy, temperature, top-k, top-p, with per-sample counter-based seeds.

Reproducibility regardless of batching: sample i's draw at step t is a pure function of
(seed_i, t) (a 32-bit integer hash turned into one uniform number, then an inverse-CDF pick),
so neither its position in the batch nor its neighbours change it. All work is batched: no
Python loop over samples.
"""

from __future__ import annotations

import torch

from slurm_align.generation.params import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (split c into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser: a bijective avalanche mix of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """One uniform float32 in [0, 1) per seed for this step: a pure function of (seed, step)."""
    s = seeds.long()
    lo, hi = s & _M32, (s >> 32) & _M32
    h = _fmix32(_fmix32(lo) ^ hi)
    h = _fmix32(h ^ _mul32(torch.full_like(h, step & _M32) + 1, 0x9E3779B9))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (masked entries become -inf). logits [B, V] float32."""
    x = logits / params.temperature if params.temperature != 1.0 else logits
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        srt, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(srt, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top one always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return x


def select_tokens(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, step: int,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next tokens [B] (never >= vocab_size) and their log-probs under softmax(logits / T), T the
    sampling temperature (1 when greedy), before top-k/top-p: the distribution the trainer
    recomputes as pi_old (models.forward.next_token_logprobs at the same temperature). Top-k/top-p
    truncation is not in it (the trainer's policy has no truncation either)."""
    logits = logits[:, :vocab_size].float()
    t = params.logprob_temperature
    logp = torch.log_softmax(logits / t if t != 1.0 else logits, -1) if params.return_logprobs else None
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        plain = params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0
        probs = logp.exp() if plain and logp is not None else torch.softmax(filter_logits(logits, params), dim=-1)
        cdf = probs.cumsum(-1)
        target = counter_uniform(seeds, step).to(cdf.device) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=vocab_size - 1)
        # Rounding at the top end could land on a zero-probability tail entry: take the mode then.
        ok = probs.gather(1, tokens.unsqueeze(1)).squeeze(1) > 0
        tokens = torch.where(ok, tokens, probs.argmax(-1))
    logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1) if logp is not None else None
    return tokens, logprobs
