"""Tokenised datasets, right-padded batches, and a resumable data order.

Sequences are [BOS] prompt response [EOS], truncated to max_seq_len. A "response mask" marks
the positions whose NEXT token is a response token (where an LM loss/log-prob counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from slurm_align.data.jsonl import PREFERENCE_KEYS, PROMPT_KEYS, SFT_KEYS, read_jsonl


@dataclass(frozen=True)
class Sequence:
    ids: list[int]
    prompt_len: int  # tokens before the response, BOS included


def encode_pair(tok, prompt: str, response: str, max_len: int) -> Sequence:
    p = [tok.bos_id] + tok.encode(prompt)
    ids = (p + tok.encode(response) + [tok.eos_id])[:max_len]
    return Sequence(ids, min(len(p), max_len))


def encode_prompt(tok, prompt: str, max_len: int) -> list[int]:
    return ([tok.bos_id] + tok.encode(prompt))[:max_len]


class SFTDataset:
    def __init__(self, path: str | Path, tok, max_len: int):
        self.rows = read_jsonl(path, SFT_KEYS, "SFT")
        self.items = [encode_pair(tok, r["input"], r["output"], max_len) for r in self.rows]
        self.pad_id = tok.pad_id

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: list[int]) -> dict:
        seqs = [self.items[i] for i in indices]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1])}


class PreferenceDataset:
    """Each item is a (chosen, rejected) pair sharing a prompt."""

    def __init__(self, path: str | Path, tok, max_len: int):
        self.rows = read_jsonl(path, PREFERENCE_KEYS, "preference")
        self.chosen = [encode_pair(tok, r["prompt"], r["chosen"], max_len) for r in self.rows]
        self.rejected = [encode_pair(tok, r["prompt"], r["rejected"], max_len) for r in self.rows]
        self.pad_id = tok.pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: list[int]) -> dict:
        """tokens [2n, s]: the n chosen sequences, then the n rejected ones, in the same order."""
        seqs = [self.chosen[i] for i in indices] + [self.rejected[i] for i in indices]
        tokens, lengths = pad([s.ids for s in seqs], self.pad_id)
        return {"tokens": tokens, "lengths": lengths, "mask": response_mask(seqs, tokens.shape[1])}


class PromptDataset:
    def __init__(self, path: str | Path, tok, max_len: int):
        self.rows = read_jsonl(path, PROMPT_KEYS, "prompt")
        self.items = [encode_prompt(tok, r["prompt"], max_len) for r in self.rows]

    def __len__(self) -> int:
        return len(self.items)


def pad(seqs: list[list[int]], pad_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    length = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, torch.tensor([len(s) for s in seqs], dtype=torch.long)


def response_mask(seqs: list[Sequence], length: int) -> torch.Tensor:
    """[n, length-1] float: 1 where position t predicts a response token t+1."""
    mask = torch.zeros(len(seqs), length - 1)
    for i, s in enumerate(seqs):
        mask[i, s.prompt_len - 1 : len(s.ids) - 1] = 1.0
    return mask


class DataOrder:
    """Which samples each step uses: a seeded permutation per epoch, a pure function of the
    step, so resuming at step k reproduces exactly the batches an uninterrupted run would see."""

    def __init__(self, n: int, global_batch: int, seed: int):
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + 7919 * epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[int]:
        start = step * self.global_batch
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + self.global_batch)]

    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        idx = self.global_indices(step)
        per = len(idx) // dp_size
        return idx[dp_rank * per : (dp_rank + 1) * per]
