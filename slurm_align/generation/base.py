"""The engine protocol and what the torch engines share: prompt packing and response recording.

Protocol: `refit(full_state_dict)` (first call builds/allocates, later calls copy in place),
`generate(prompts, params, seeds=None) -> GenerationOutput`, `free()` (drop weights and
caches, e.g. during training; the next refit builds again).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from slurm_align.generation.params import GenerationError, GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.weights import GptWeights


@runtime_checkable
class Engine(Protocol):
    shape: GptShape

    def refit(self, full_state_dict: dict[str, torch.Tensor]) -> float:
        """Load new weights (megatron TP=1 naming); returns the seconds it took."""

    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        """Responses for ragged 1-D int prompts; seeds[i] drives sample i's draws."""

    def free(self) -> None:
        """Release weights and caches (the engine is rebuilt by the next refit)."""


@dataclass
class PromptBatch:
    """Ragged prompts left-padded to a common length P, with per-sequence positions."""

    tokens: torch.Tensor      # [B, P] int64
    positions: torch.Tensor   # [B, P] int64 (0 on padding)
    key_valid: torch.Tensor   # [B, P] bool
    lengths: torch.Tensor     # [B] int64
    seeds: torch.Tensor       # [B] int64 (CPU)


def pack_prompts(prompts: Sequence[torch.Tensor], shape: GptShape, params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None, device: torch.device) -> PromptBatch:
    if len(prompts) == 0:
        raise GenerationError("generate() got no prompts")
    lengths = torch.tensor([int(p.numel()) for p in prompts], dtype=torch.int64)
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise GenerationError(f"prompt {i}: must be a non-empty 1-D token tensor, got shape {tuple(p.shape)}")
    longest = int(lengths.max())
    if longest + params.max_new_tokens > shape.max_seq_len:
        i = int(lengths.argmax())
        raise GenerationError(
            f"prompt {i} has {longest} tokens; with max_new_tokens={params.max_new_tokens} that is "
            f"{longest + params.max_new_tokens} > the model's max_seq_len={shape.max_seq_len}: "
            f"shorten the prompt or lower max_new_tokens")
    flat = torch.cat([p.reshape(-1).long().cpu() for p in prompts])
    if int(flat.min()) < 0 or int(flat.max()) >= shape.vocab_size:
        raise GenerationError(f"prompt token ids must be in [0, {shape.vocab_size}), got "
                              f"[{int(flat.min())}, {int(flat.max())}]")
    if seeds is None:
        seeds_t = params.seed + torch.arange(len(prompts), dtype=torch.int64)
    else:
        seeds_t = torch.as_tensor(seeds, dtype=torch.int64).reshape(-1).cpu()
        if seeds_t.numel() != len(prompts):
            raise GenerationError(f"seeds: got {seeds_t.numel()} for {len(prompts)} prompts (need one each)")
    if int(seeds_t.min()) < 0:
        raise GenerationError("seeds must be >= 0")
    b = len(prompts)
    pad = longest - lengths
    col = torch.arange(longest).unsqueeze(0)
    key_valid = col >= pad.unsqueeze(1)
    tokens = torch.zeros(b, longest, dtype=torch.int64)
    tokens[key_valid] = flat
    positions = (col - pad.unsqueeze(1)).clamp_(min=0)
    return PromptBatch(tokens.to(device), positions.to(device), key_valid.to(device),
                       lengths.to(device), seeds_t)


class ResponseRecorder:
    """Collects one token per active sample per step; tracks EOS, stop sequences, lengths and is_end."""

    def __init__(self, n: int, params: SamplingParams, device: torch.device):
        self.params = params
        m = params.max_new_tokens
        self.tokens = torch.full((n, m), params.pad_id, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(n, m, dtype=torch.float32, device=device) if params.return_logprobs else None
        self.lengths = torch.zeros(n, dtype=torch.int64, device=device)
        self.is_end = torch.zeros(n, dtype=torch.bool, device=device)
        self.stops = [torch.tensor(q, dtype=torch.int64, device=device) for q in params.stop_token_sequences]

    def record(self, step: int, rows: torch.Tensor, alive: torch.Tensor, tokens: torch.Tensor,
               logprobs: torch.Tensor | None) -> torch.Tensor:
        """Store this step's tokens for rows still alive; returns the new alive mask."""
        self.tokens[rows, step] = torch.where(alive, tokens, self.params.pad_id)
        if self.logprobs is not None:
            self.logprobs[rows, step] = torch.where(alive, logprobs, 0.0)
        self.lengths[rows] += alive
        hit = torch.zeros_like(alive)
        if self.params.eos_id is not None:
            hit |= alive & (tokens == self.params.eos_id)
        for seq in self.stops:   # a live row has generated step + 1 tokens
            k = len(seq)
            if step + 1 >= k:
                hit |= alive & (self.tokens[rows, step + 1 - k:step + 1] == seq).all(dim=1)
        self.is_end[rows] |= hit
        return alive & ~hit

    def output(self) -> GenerationOutput:
        width = int(self.lengths.max()) if self.lengths.numel() else 0
        lp = self.logprobs[:, :width].cpu() if self.logprobs is not None else None
        return GenerationOutput(self.tokens[:, :width].cpu(), self.lengths.cpu(), self.is_end.cpu(), lp)


class TorchEngineBase:
    """Weights handling shared by the torch engines."""

    def __init__(self, shape: GptShape, device: torch.device | str = "cpu"):
        self.shape = shape
        self.device = torch.device(device)
        self.weights = GptWeights(shape, self.device)

    def refit(self, full_state_dict: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.weights.load(full_state_dict)
        return time.perf_counter() - t0

    def free(self) -> None:
        self.weights.free()

    def _check_ready(self) -> None:
        if not self.weights.loaded:
            raise GenerationError(f"{type(self).__name__}: no weights; call refit(full_state_dict) first")
