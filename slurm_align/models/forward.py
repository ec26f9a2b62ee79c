"""Forward (and forward+backward) of model chunks over TP/PP through megatron's schedules.

Batches are right-padded token ids [batch, seq]; attention is causal, so padding after a
sequence never changes that sequence's logits/values. Every rank of a model-parallel group
passes the same batch (stages other than the first ignore the tokens).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from slurm_align.models.gpt import model_device


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron's mask convention: True = masked out. Shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def model_inputs(tokens: torch.Tensor) -> dict:
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return {"input_ids": tokens, "position_ids": pos, "attention_mask": causal_mask(s, tokens.device)}


def split_microbatches(tokens: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    return list(torch.split(tokens, micro_batch_size, dim=0))


def run_schedule(
    chunks: list,
    microbatches: list[dict],
    loss_fn: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]],
    *,
    forward_only: bool,
) -> list[dict]:
    """Run megatron's forward(-backward) schedule over `microbatches` (dicts with "tokens"
    [mb, s] of equal shapes, plus whatever `loss_fn` needs).

    `loss_fn(output, mb)` runs on the last stage and returns (loss, info dict); the schedule
    divides the loss by the number of micro-batches, so loss_fn should return its share times
    len(microbatches) (see the trainers). Returns the info dicts (last stage only; [] elsewhere).
    Gradients accumulate into .grad on backward; DP reduction is the caller's job.
    """
    device = model_device(chunks)
    n = len(microbatches)
    mb_size, seq_len = microbatches[0]["tokens"].shape
    it = iter(microbatches)

    def step(data_iterator, model):
        mb = next(data_iterator)
        tokens = mb["tokens"].to(device)
        output = model(**model_inputs(tokens))

        def loss_func(output_tensor):
            loss, info = loss_fn(output_tensor, mb)
            return loss * n, info

        return output, loss_func

    schedule = get_forward_backward_func()
    return schedule(
        forward_step_func=step,
        data_iterator=it,
        model=chunks,
        num_microbatches=n,
        seq_length=seq_len,
        micro_batch_size=mb_size,
        forward_only=forward_only,
    )


def _gathered_logits(output: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # output: [b, s, V/tp] (parallel_output=True); gather the vocab shards over TP.
    return gather_from_tensor_model_parallel_region(output)[..., :vocab_size]


@torch.no_grad()
def forward_logits(chunks: list, pctx: Any, tokens: torch.Tensor, vocab_size: int, *,
                   micro_batch_size: int | None = None, broadcast: bool = False) -> torch.Tensor | None:
    """Logits [batch, seq, vocab_size] (TP-gathered, padding vocab dropped), float32 on CPU.

    Returned on the last pipeline stage; other stages get None unless `broadcast` (then every
    rank of the PP group gets the tensor). Eval mode is the caller's choice (no dropout anyway).
    """
    return _forward(chunks, pctx, tokens, lambda out: _gathered_logits(out, vocab_size),
                    micro_batch_size, broadcast, extra_dim=(vocab_size,))


@torch.no_grad()
def forward_values(chunks: list, pctx: Any, tokens: torch.Tensor, *,
                   micro_batch_size: int | None = None, broadcast: bool = False) -> torch.Tensor | None:
    """Per-token values [batch, seq] of a value/reward model (build_gpt(value_head=True))."""
    return _forward(chunks, pctx, tokens, lambda out: out, micro_batch_size, broadcast, extra_dim=())


def last_token_values(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reward of each sequence: its value at index length-1."""
    return values.gather(1, (lengths.long() - 1).clamp(min=0).unsqueeze(1).to(values.device)).squeeze(1)


def _forward(chunks, pctx, tokens, post, micro_batch_size, broadcast, extra_dim) -> torch.Tensor | None:
    tokens = tokens.long()
    mbs = micro_batch_size or tokens.shape[0]
    microbatches = [{"tokens": t} for t in split_microbatches(tokens, mbs)]
    # Pipeline p2p buffers have a fixed micro-batch shape: pad the last micro-batch.
    short = mbs - microbatches[-1]["tokens"].shape[0]
    if short:
        pad = microbatches[-1]["tokens"][-1:].expand(short, -1)
        microbatches[-1] = {"tokens": torch.cat([microbatches[-1]["tokens"], pad])}

    def loss_fn(output, mb):
        return output.new_zeros(()), {"out": post(output.float()).cpu()}

    infos = run_schedule(chunks, microbatches, loss_fn, forward_only=True)
    result = None
    if pctx.is_last_stage:
        result = torch.cat([i["out"] for i in infos])[: tokens.shape[0]]
    if broadcast and pctx.pp_size > 1:
        shape = (tokens.shape[0], tokens.shape[1], *extra_dim)
        device = model_device(chunks)  # NCCL broadcasts device tensors only
        buf = result.to(device) if result is not None else torch.empty(shape, dtype=torch.float32, device=device)
        src = torch.distributed.get_global_rank(pctx.pp_group, pctx.pp_size - 1)
        torch.distributed.broadcast(buf, src=src, group=pctx.pp_group)
        result = buf.cpu()
    return result
