"""The KV-cache torch engine: batched prefill of ragged prompts, then one-token decode steps.

Prompts are left-padded to a common length P with per-sequence positions, so every sequence
writes its step-t keys/values into the same cache column P+t and the whole batch advances in
one set of batched ops per layer (no per-sample Python work). The cache [L, 2, B, groups, S, d]
(groups = key/value heads: GQA keys/values are cached once per group)
is one preallocated buffer reused across calls. Finished samples stay in the batch, masked,
until a quarter of it has finished; then the batch (cache included) is compacted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slurm_align.generation.base import PromptBatch, ResponseRecorder, TorchEngineBase, pack_prompts
from slurm_align.generation.params import GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.sampling import select_tokens
from slurm_align.generation.transformer import decode_step, forward_full

# Compact the active batch once its live fraction drops to this (compaction copies the cache).
_COMPACT_AT = 0.75


class KVCacheEngine(TorchEngineBase):
    def __init__(self, shape: GptShape, device: torch.device | str = "cpu"):
        super().__init__(shape, device)
        self._kv_store: torch.Tensor | None = None

    def free(self) -> None:
        super().free()
        self._kv_store = None

    def _kv_cache(self, batch: int, seq: int) -> torch.Tensor:
        s = self.shape
        dims = (s.num_layers, 2, batch, s.query_groups, seq, s.head_dim)
        numel = 1
        for d in dims:
            numel *= d
        if self._kv_store is None or self._kv_store.numel() < numel:
            self._kv_store = torch.empty(numel, dtype=self.weights.dtype, device=self.device)
        return self._kv_store[:numel].view(dims)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        self._check_ready()
        batch: PromptBatch = pack_prompts(prompts, self.shape, params, seeds, self.device)
        b, p = batch.tokens.shape
        m = params.max_new_tokens
        kv = self._kv_cache(b, p + m)
        logits = forward_full(self.weights, batch.tokens, batch.positions, batch.key_valid,
                              last_only=True, kv_out=kv)
        key_bias = torch.zeros(b, 1, 1, p + m, dtype=kv.dtype, device=self.device)
        key_bias[:, 0, 0, :p].masked_fill_(~batch.key_valid, float("-inf"))

        rec = ResponseRecorder(b, params, self.device)
        rows = torch.arange(b, device=self.device)
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        positions = batch.lengths.clone()
        seeds_t = batch.seeds
        for t in range(m):
            nxt, lp = select_tokens(logits, params, seeds_t, t, self.shape.vocab_size)
            alive = rec.record(t, rows, alive, nxt, lp)
            if t == m - 1:
                break
            if params.stops_early:
                live = int(alive.sum())
                if live == 0:
                    break
                if live <= _COMPACT_AT * rows.numel():
                    keep = alive.nonzero().squeeze(1)
                    kv = kv.index_select(2, keep)
                    rows, alive, nxt = rows[keep], alive[keep], nxt[keep]
                    positions, key_bias = positions[keep], key_bias[keep]
                    seeds_t = seeds_t[keep.cpu()]
            logits = decode_step(self.weights, kv, nxt, positions, p + t, key_bias)
            positions += 1
        return rec.output()
