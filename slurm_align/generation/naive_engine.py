"""The ablation baseline: recompute the whole forward over prompt + response for every token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slurm_align.generation.base import PromptBatch, ResponseRecorder, TorchEngineBase, pack_prompts
from slurm_align.generation.params import GenerationOutput, SamplingParams
from slurm_align.generation.sampling import select_tokens
from slurm_align.generation.transformer import forward_full


class NaiveEngine(TorchEngineBase):
    """No KV cache, no dropping of finished samples: the cost the KV-cache engine removes."""

    @torch.inference_mode()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        self._check_ready()
        batch: PromptBatch = pack_prompts(prompts, self.shape, params, seeds, self.device)
        b, p = batch.tokens.shape
        m = params.max_new_tokens
        tokens = torch.cat([batch.tokens, batch.tokens.new_zeros(b, m)], 1)
        positions = torch.cat([batch.positions, batch.lengths[:, None] + torch.arange(m, device=self.device)], 1)
        valid = torch.cat([batch.key_valid, batch.key_valid.new_ones(b, m)], 1)
        rec = ResponseRecorder(b, params, self.device)
        rows = torch.arange(b, device=self.device)
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        for t in range(m):
            n = p + t
            logits = forward_full(self.weights, tokens[:, :n], positions[:, :n], valid[:, :n], last_only=True)
            nxt, lp = select_tokens(logits, params, batch.seeds, t, self.shape.vocab_size)
            alive = rec.record(t, rows, alive, nxt, lp)
            tokens[:, n] = nxt
            if params.stops_early and not bool(alive.any()):
                break
        return rec.output()
