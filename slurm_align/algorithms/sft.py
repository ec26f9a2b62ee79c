"""Supervised fine-tuning: next-token cross-entropy on response tokens only."""

from __future__ import annotations

from slurm_align.data.datasets import SFTDataset
from slurm_align.models.forward import sequence_token_logprobs


class SFT:
    name = "sft"
    value_head = False
    pairs = False

    def __init__(self, run):
        self.vocab_size = run.model.vocab_size

    def dataset(self, path, tok, max_len, columns=None):
        return SFTDataset(path, tok, max_len, columns)

    def local_norm(self, microbatches) -> float:
        return float(sum(mb["mask"].sum() for mb in microbatches))  # response tokens

    def setup(self, trainer) -> None:
        pass

    def prepare(self, trainer, microbatches) -> None:
        pass

    def loss(self, output, mb):
        lp = sequence_token_logprobs(output, mb, self.vocab_size)   # padded or packed micro-batch
        mask = mb["mask"].to(lp.device)
        loss_sum = -(lp * mask).sum()
        return loss_sum / mb["norm"], {"loss_sum": loss_sum.detach(), "tokens": mask.sum()}

    @staticmethod
    def metrics(s: dict) -> dict:
        return {"loss": float(s["loss_sum"] / s["tokens"].clamp(min=1))}
