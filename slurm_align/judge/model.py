"""The judge model: the project's GPT (models/gpt.py) loaded from a checkpoint (or an HF folder),
asked for the next-token log-probs of the allowed answers after each judging prompt.

One forward over the batch of prompts (models/forward.forward_logits, padded micro-batches,
collective over the component's ranks like every forward); the answer of a prompt is read at its
last position. Each allowed answer must be a single token of the judge's tokenizer (its first
token would otherwise stand for several answers): checked at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.config.run import ModelConfig
from slurm_align.data.datasets import encode_prompt
from slurm_align.models.checkpoint import find_latest, load_weights
from slurm_align.models.forward import forward_logits
from slurm_align.models.gpt import build_gpt
from slurm_align.models.tokenizer import build_tokenizer


class JudgeModelError(ValueError):
    """An allowed answer that is not one token of the judge's tokenizer, or a prompt too long."""


def answer_token_ids(tok, answers: Sequence[str]) -> list[int]:
    ids = []
    for a in answers:
        enc = tok.encode(a)
        if len(enc) != 1:
            raise JudgeModelError(f"judge answer {a!r} is {len(enc)} tokens of the judge's tokenizer "
                                  f"({enc}); allowed answers must be one token each")
        ids.append(enc[0])
    if len(set(ids)) != len(ids):
        raise JudgeModelError(f"judge answers {list(answers)} share a token ({ids})")
    return ids


@dataclass
class JudgeModel:
    model_cfg: ModelConfig
    chunks: list
    pctx: Any
    tokenizer: Any

    @classmethod
    def load(cls, model_cfg: ModelConfig, pctx, *, seed: int = 1234) -> JudgeModel:
        """model.init_checkpoint (a trainer's checkpoints folder: its newest, or an iter_*), else
        model.hf_path's weights."""
        chunks = build_gpt(model_cfg, pctx, seed=seed)
        if model_cfg.init_checkpoint is not None:
            path = Path(model_cfg.init_checkpoint)
            load_weights(find_latest(path) or path, chunks)
        for c in chunks:
            c.eval()
        return cls(model_cfg, chunks, pctx, build_tokenizer(model_cfg))

    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        max_len = self.model_cfg.max_seq_len
        seqs = []
        for p in prompts:
            ids = encode_prompt(self.tokenizer, p, max_len + 1)
            if len(ids) > max_len:
                raise JudgeModelError(f"judging prompt {p[:80]!r} is {len(ids)} tokens, over the judge's "
                                      f"model.max_seq_len={max_len}")
            seqs.append(ids)
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        tokens = torch.full((len(seqs), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.int64)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = torch.tensor(s)
        return tokens, lengths

    def answer_logprobs_tokens(self, tokens: torch.Tensor, lengths: torch.Tensor, answer_ids: Sequence[int],
                               micro_batch_size: int = 64) -> np.ndarray:
        """[n, len(answer_ids)]: log p(answer | prompt) over the whole vocabulary (collective)."""
        logits = forward_logits(self.chunks, self.pctx, tokens, self.model_cfg.vocab_size,
                                micro_batch_size=micro_batch_size, lengths=lengths, broadcast=True)
        assert logits is not None   # broadcast: every pipeline stage has them
        last = logits[torch.arange(len(lengths)), lengths - 1]
        logp = torch.log_softmax(last.float(), dim=-1)
        return logp[:, list(answer_ids)].numpy().astype(np.float32)

    def answer_logprobs(self, prompts: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        tokens, lengths = self.encode(prompts)
        return self.answer_logprobs_tokens(tokens, lengths, answer_token_ids(self.tokenizer, answers))
