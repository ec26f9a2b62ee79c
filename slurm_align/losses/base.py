"""The one interface of every loss the model worker trains with (models/worker.py).

A loss says what it reads (`columns` of the micro-batch, `pairs`, `value_head`, `reference`)
and computes, per micro-batch on the last pipeline stage, its share of the global loss and the
sums its metrics are made of. The worker owns everything else: micro-batching, the global
normaliser (the sum of `count` over micro-batches and data-parallel ranks, put in mb["norm"]),
the reference log-probs (mb["ref_logp"] when `reference`), the backward pass, the optimizer
step and the reduction of the sums over micro-batches, DP and PP before `metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from slurm_align.data.datasets import PreferenceDataset, SFTDataset
from slurm_align.models.forward import sequence_token_logprobs


class Loss:
    name: ClassVar[str] = ""
    pairs: ClassVar[bool] = False
    """Items are (chosen, rejected) pairs: a micro-batch holds the n chosen sequences, then the
    n rejected ones (PreferenceDataset.batch)."""
    value_head: ClassVar[bool] = False
    """The model ends in a value head (scores) instead of the LM head (logits)."""
    value_outputs: int = 1
    """Outputs of the value head (a regression reward model has one per attribute)."""
    reference: ClassVar[bool] = False
    """Needs the frozen reference policy's per-token log-probs (mb["ref_logp"] [b, s-1])."""
    columns: ClassVar[tuple[str, ...]] = ("tokens", "lengths", "mask", "real")
    """Micro-batch keys the loss reads (the worker checks them before the first forward)."""
    optional_columns: ClassVar[tuple[str, ...]] = ()
    """Keys the loss reads where the data has them (e.g. rollout-correction weights)."""
    sum_keys: ClassVar[tuple[str, ...]] = ()
    """The keys of the loss's metric sums, for a rank (or a step) without micro-batches: a
    loss that declares them may get a step where nothing counts on any DP rank (the RL actor's
    all-filtered batches); the worker then runs no forward and steps with zero gradients."""

    def __init__(self, options: Any, model: Any):
        self.options = options
        self.vocab_size = model.vocab_size

    def dataset(self, path, tok, max_len: int, columns: Mapping[str, str] | None = None, truncate: bool = False):
        """The data set this loss trains on (JSONL, parquet, Arrow, a saved HF dataset, or a
        data/mixture.py MixtureSpec; `columns`: data.columns, our keys -> the file's; `truncate`:
        data.truncate, cut rows longer than max_len instead of refusing them)."""
        return (PreferenceDataset(path, tok, max_len, columns, truncate) if self.pairs
                else SFTDataset(path, tok, max_len, columns, truncate))

    def count(self, mb: dict) -> float:
        """This micro-batch's part of the global normaliser (pairs or real sequences by default)."""
        return float(mb["real"].sum())

    def __call__(self, output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss sum / mb["norm"], {metric sums}) of one micro-batch."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's metrics from the sums reduced over micro-batches, DP and PP."""
        raise NotImplementedError

    # --- helpers the losses share -------------------------------------------------------
    def token_logprobs(self, output: torch.Tensor, mb: dict) -> torch.Tensor:
        """Next-token log-probs [b, s-1] of the micro-batch's sequences (padded or packed)."""
        return sequence_token_logprobs(output, mb, self.vocab_size)


def sequence_logprobs(token_logp: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per sequence [b]: the sum (or, with `average`, the mean) of its masked tokens' log-probs."""
    mask = mask.to(token_logp.device, token_logp.dtype)
    total = (token_logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total
