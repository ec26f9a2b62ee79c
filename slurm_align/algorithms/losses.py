"""Pieces shared by the SFT / RM / DPO losses (run on the last pipeline stage)."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region


def token_logprobs(output: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) as [b, s-1]. `output` is the LM's TP-sharded
    logits [b, s, V/tp]; they are gathered (backward splits the gradient again) and the
    padding vocabulary is dropped, so padding ids never get probability mass. `temperature`:
    p = softmax(logits / temperature), the policy a rollout sampled at that temperature
    (the engines report the same; see generation.params.logprob_temperature)."""
    return next_token_logprobs(gather_from_tensor_model_parallel_region(output)[..., :vocab_size], tokens,
                               temperature)


def next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The same from already gathered, padding-free logits [b, s, vocab]: [b, s-1]."""
    x = logits[:, :-1].float()
    logp = torch.log_softmax(x / temperature if temperature != 1.0 else x, dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1).to(logp.device)).squeeze(-1)


def sequence_logprobs(output, tokens, mask, vocab_size) -> torch.Tensor:
    """Sum of response-token log-probs per sequence [b]."""
    return (token_logprobs(output, tokens, vocab_size) * mask.to(output.device)).sum(-1)
