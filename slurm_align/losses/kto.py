"""KTO: unpaired desirable / undesirable responses against the frozen reference, with the
reference point z0 estimated from mismatched prompt/response pairs (losses/registry.py
KTOOptions has the formula).

Rows are SFT rows with a boolean "label" (true: desirable), e.g.
{"input": "3142=", "output": "1234", "label": true}. Each item is two sequences, as a pair is:
the row itself, then its prompt with the next row's response (the mismatched pair z0 reads).
z0 is the mean over the micro-batch's mismatched pairs (TRL takes it over the whole batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import Sequence, SFTDataset, pad, response_mask
from slurm_align.losses.base import Loss, sequence_logprobs
from slurm_align.losses.registry import KTOOptions


class KTODataset:
    """Labelled SFT rows; batch() gives the items' own sequences then their mismatched twins,
    plus "desirable" [n] (1.0 / 0.0)."""

    def __init__(self, path: Any, tok, max_len: int, columns: Mapping[str, str] | None = None,
                 truncate: bool = False):
        self.sft = SFTDataset(path, tok, max_len, columns, truncate)
        self.pad_id, self.tok, self.max_len = self.sft.pad_id, tok, max_len
        self.path = Path(getattr(path, "path", path))
        if len(self.sft) < 2:
            raise ConfigError(["KTO needs at least 2 rows (z0 pairs a prompt with another row's response)"], self.path)

    def label(self, i: int) -> float:
        """Row i's label (1.0 desirable, 0.0 not), read with the row."""
        row = self.sft.rows[i]
        v = {**row.extra, **row.data}.get("label")
        if not isinstance(v, bool):
            raise ConfigError([f"{row.where}: 'label' must be true (desirable) or false (undesirable), got {v!r}"],
                              row.path or self.path)
        return float(v)

    def __len__(self) -> int:
        return len(self.sft)

    def _mismatched(self, i: int) -> Sequence:
        """Row i's prompt with row i+1's response (cut to max_len)."""
        own, other = self.sft.items[i], self.sft.items[(i + 1) % len(self.sft)]
        ids = (own.ids[:own.prompt_len] + other.ids[other.prompt_len:])[:self.max_len]
        return Sequence(ids, min(own.prompt_len, len(ids)), None)

    def item_tokens(self, indices: list[int]) -> np.ndarray:
        return np.asarray([len(self.sft.items[i].ids) + len(self._mismatched(i).ids) for i in indices],
                          dtype=np.int64)

    def batch(self, indices: list[int]) -> dict:
        seqs = [self.sft.items[i] for i in indices] + [self._mismatched(i) for i in indices]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1]),
                "desirable": torch.tensor([self.label(i) for i in indices])}


def kto_terms(logratio: torch.Tensor, mismatched: torch.Tensor, desirable: torch.Tensor, real: torch.Tensor,
              opts: KTOOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (the KTO loss [n], z0 []). `logratio`, `mismatched`: log pi - log ref of the rows'
    own and mismatched responses [n]; `desirable`, `real`: 1.0 / 0.0 per row."""
    z0 = ((mismatched * real).sum() / real.sum().clamp(min=1)).clamp(min=0).detach()
    good = opts.desirable_weight * (1 - torch.sigmoid(opts.beta * (logratio - z0)))
    bad = opts.undesirable_weight * (1 - torch.sigmoid(opts.beta * (z0 - logratio)))
    return torch.where(desirable > 0, good, bad), z0


class KTO(Loss):
    name = "kto"
    pairs = True   # two sequences per item: the row, then its mismatched twin
    reference = True
    columns = ("tokens", "lengths", "mask", "real", "desirable")

    options: KTOOptions

    def dataset(self, path, tok, max_len: int, columns: Mapping[str, str] | None = None, truncate: bool = False):
        return KTODataset(path, tok, max_len, columns, truncate)

    def __call__(self, output, mb):
        lp = self.token_logprobs(output, mb)
        mask = mb["mask"].to(lp.device)
        ratio = sequence_logprobs(lp, mask) - sequence_logprobs(mb["ref_logp"].to(lp), mask)
        own, mismatched = ratio.chunk(2)
        real = mb["real"].to(lp.device)
        desirable = mb["desirable"].to(lp.device)
        loss, z0 = kto_terms(own, mismatched, desirable, real, self.options)
        loss_sum = (loss * real).sum()
        return loss_sum / mb["norm"], {
            "loss_sum": loss_sum.detach(), "rows": real.sum(), "z0_sum": z0 * real.sum(),
            "desirable_logratio_sum": (own.detach() * real * desirable).sum(), "desirable": (real * desirable).sum(),
            "undesirable_logratio_sum": (own.detach() * real * (1 - desirable)).sum()}

    def metrics(self, s):
        n = s["rows"].clamp(min=1)
        nd = s["desirable"]
        return {"loss": float(s["loss_sum"] / n), "z0": float(s["z0_sum"] / n),
                "desirable_logratio": float(s["desirable_logratio_sum"] / nd.clamp(min=1)),
                "undesirable_logratio": float(s["undesirable_logratio_sum"] / (s["rows"] - nd).clamp(min=1))}
