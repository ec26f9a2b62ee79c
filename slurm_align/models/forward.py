"""Forward (and forward+backward) of model chunks over TP/PP through megatron's schedules.

Batches are right-padded token ids [batch, seq]; attention is causal, so padding after a
sequence never changes that sequence's logits/values. Every rank of a model-parallel group
passes the same batch (stages other than the first ignore the tokens).

A micro-batch dict may instead be packed (models/packing.py): "tokens" are then its packed rows
[rows, width] and "packing" their PackedLayout; the model sees per-sequence positions and
attention (a block-diagonal mask on CPU, THD cu_seqlens with Transformer Engine), and loss
functions take outputs back to the padded layout with `per_sequence` / `sequence_token_logprobs`.
`Batching` (micro-batches by sample count or token budget, packed or padded) chooses the layout
for `forward_logits` / `forward_logprobs` / `forward_values`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from slurm_align.models.gpt import TE_DTYPES, model_device
from slurm_align.models.packing import Batching, PackedLayout, micro_batch_inputs, rope_at_positions


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """megatron's mask convention: True = masked out. Shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def model_inputs(tokens: torch.Tensor) -> dict:
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return {"input_ids": tokens, "position_ids": pos, "attention_mask": causal_mask(s, tokens.device)}


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


def uses_thd(model: torch.nn.Module) -> bool:
    """Whether the model's attention is Transformer Engine's (packed rows then go as THD);
    megatron's local attention takes an explicit mask instead. TE runs THD in fp16/bf16 only
    (gpt.TE_DTYPES; gpt.layer_spec builds fp32 models with the local spec): a TE model of
    another precision is refused here, where TE itself would fail with "no attention backend"."""
    if not any(type(m).__name__ == "TEDotProductAttention" for m in model.modules()):
        return False
    dtype = next(model.parameters()).dtype
    if dtype not in TE_DTYPES:
        raise ValueError(f"packed micro-batches through Transformer Engine's attention need parameters in "
                         f"{' or '.join(str(d) for d in TE_DTYPES)}, got {dtype} (TE has no {dtype} backend for "
                         "the packed THD layout): build the model with slurm_align.models.gpt.layer_spec, which "
                         "takes megatron's local spec in fp32, or turn packing off")
    return True


def packed_inputs(layout: PackedLayout, rows: torch.Tensor, thd: bool) -> dict:
    """Model kwargs of packed rows [rows, width]: per-sequence positions, and attention kept
    inside each sequence (THD: the rows flattened into one sequence with cu_seqlens)."""
    pos = layout.position_ids().to(rows.device)
    if not thd:
        return {"input_ids": rows, "position_ids": pos, "attention_mask": layout.attention_mask().to(rows.device)}
    cu = layout.cu_seqlens().to(rows.device)
    longest = layout.max_segment()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    return {"input_ids": rows.reshape(1, -1), "position_ids": pos.reshape(1, -1), "attention_mask": None,
            "packed_seq_params": params}


def per_sequence(output: torch.Tensor, mb: dict, drop_last: int = 0) -> torch.Tensor:
    """A model output over the micro-batch's positions ([rows, width, ...] packed, [b, s, ...]
    padded) in the padded layout [b, s, ...] (s: the longest sequence of the micro-batch when
    packed). THD outputs ([1, rows*width, ...]) are folded back into rows first."""
    layout = mb.get("packing")
    if layout is None:
        return output
    if output.shape[0] != layout.rows:
        output = output.reshape(layout.rows, layout.width, *output.shape[2:])
    return layout.unpack(output, int(layout.lengths.max()) - drop_last, drop_last=drop_last)


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
        layout = mb.get("packing")
        if layout is None:
            output = model(**model_inputs(tokens))
        else:
            thd = uses_thd(model)
            inputs = packed_inputs(layout, tokens, thd)
            # THD: megatron's RoPE restarts per sequence from cu_seqlens itself.
            with contextlib.nullcontext() if thd else rope_at_positions(model, inputs["position_ids"]):
                output = model(**inputs)

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


def _batching(batching: Batching | None, micro_batch_size: int | None) -> Batching:
    return batching if batching is not None else Batching(micro_batch_size=micro_batch_size)


@torch.no_grad()
def forward_logits(chunks: list, pctx: Any, tokens: torch.Tensor, vocab_size: int, *,
                   micro_batch_size: int | None = None, broadcast: bool = False,
                   lengths: torch.Tensor | None = None, batching: Batching | None = None) -> torch.Tensor | None:
    """Logits [batch, seq, vocab_size] (TP-gathered, padding vocab dropped), float32 on CPU.

    Returned on the last pipeline stage; other stages get None unless `broadcast` (then every
    rank of the PP group gets the tensor). Eval mode is the caller's choice (no dropout anyway).
    `lengths` (default: every row full) and `batching` (default: micro-batches of
    `micro_batch_size` rows, padded) choose the micro-batches; positions past a sequence's
    length are 0 when packed (padding's logits otherwise).
    """
    return _forward(chunks, pctx, tokens, lambda out, mb: per_sequence(_gathered_logits(out, vocab_size), mb),
                    _batching(batching, micro_batch_size), lengths, broadcast, extra_dim=(vocab_size,))


@torch.no_grad()
def forward_top_k(chunks: list, pctx: Any, tokens: torch.Tensor, vocab_size: int, k: int, *,
                  micro_batch_size: int | None = None, lengths: torch.Tensor | None = None,
                  batching: Batching | None = None,
                  broadcast: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K largest next-token log-probs at each position and their token ids ([batch, seq, k]
    each, descending): log_softmax of the float32 TP-gathered logits, as next_token_logprobs
    takes it, reduced to the top K per micro-batch (of `micro_batch_size` rows, or `batching`),
    so only one micro-batch's [rows, seq, vocab] log-probs exist at once. Position p is the
    distribution of token p+1. Last stage (or, with `broadcast`, every PP rank); None elsewhere."""
    def post(out, mb):
        top = torch.log_softmax(per_sequence(_gathered_logits(out, vocab_size), mb), dim=-1).topk(k, dim=-1)
        return torch.cat([top.values, top.indices.float()], -1)   # ids < 2**24: exact in float32
    both = _forward(chunks, pctx, tokens, post, _batching(batching, micro_batch_size), lengths, broadcast,
                    extra_dim=(2 * k,))
    return None if both is None else (both[..., :k], both[..., k:].long())


@torch.no_grad()
def forward_logprobs(chunks: list, pctx: Any, tokens: torch.Tensor, vocab_size: int, *,
                     lengths: torch.Tensor | None = None, batching: Batching | None = None,
                     broadcast: bool = False, temperature: float = 1.0) -> torch.Tensor | None:
    """Next-token log-probs [batch, seq-1] (position p: log p(tokens[p+1] | tokens[:p+1])) at
    `temperature`, computed per micro-batch, so the [batch, seq, vocab] logits never exist at
    once. Positions p >= length-1 are not meaningful (0 when packed)."""
    def post(out, mb):
        return sequence_token_logprobs(out, mb, vocab_size, temperature)
    return _forward(chunks, pctx, tokens, post, _batching(batching, None), lengths, broadcast,
                    extra_dim=(), width_delta=-1)


def sequence_token_logprobs(output: torch.Tensor, mb: dict, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """Next-token log-probs of a micro-batch's sequences [b, s-1] in the padded layout, from the
    LM's TP-sharded output, for packed and padded micro-batches alike (differentiable), at
    `temperature` (token_logprobs)."""
    layout = mb.get("packing")
    if layout is None:
        return token_logprobs(output, mb["tokens"], vocab_size, temperature)
    rows = mb["tokens"].reshape(layout.rows, layout.width)
    if output.shape[0] != layout.rows:   # THD: [1, rows * width, V/tp]
        output = output.reshape(layout.rows, layout.width, *output.shape[2:])
    lp = token_logprobs(output, rows, vocab_size, temperature)   # [rows, width-1]
    return layout.unpack(lp, int(layout.lengths.max()) - 1, drop_last=1)


@torch.no_grad()
def forward_values(chunks: list, pctx: Any, tokens: torch.Tensor, *,
                   micro_batch_size: int | None = None, broadcast: bool = False,
                   lengths: torch.Tensor | None = None, batching: Batching | None = None,
                   num_labels: int = 1) -> torch.Tensor | None:
    """Per-token values [batch, seq] of a value/reward model (build_gpt(value_head=True));
    [batch, seq, num_labels] for a head with several outputs (a regression reward model)."""
    return _forward(chunks, pctx, tokens, per_sequence, _batching(batching, micro_batch_size), lengths,
                    broadcast, extra_dim=(num_labels,) if num_labels > 1 else ())


def last_token_values(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The reward of each sequence: its value at index length-1 ([b] from [b, s]; [b, n] from
    the [b, s, n] of a head with n outputs)."""
    last = (lengths.long() - 1).clamp(min=0).to(values.device)
    return values[torch.arange(values.shape[0], device=values.device), last]


def _forward(chunks, pctx, tokens, post, batching: Batching, lengths, broadcast, extra_dim,
             width_delta: int = 0) -> torch.Tensor | None:
    """post(output, mb) -> [b, s', ...] per sequence of the micro-batch (s' <= the batch's
    width + width_delta); the result is [B, L + width_delta, ...] in the batch's row order."""
    tokens = tokens.long()
    B, L = tokens.shape
    lengths = torch.full((B,), L, dtype=torch.int64) if lengths is None else torch.as_tensor(lengths).long()
    microbatches = micro_batch_inputs(tokens, lengths, batching.groups(lengths), pack=batching.pack,
                                      fixed_shape=pctx.pp_size > 1)

    def loss_fn(output, mb):
        return output.new_zeros(()), {"out": post(output.float(), mb).cpu()}

    infos = run_schedule(chunks, microbatches, loss_fn, forward_only=True) if B else []
    width = max(L + width_delta, 0)
    shape = (B, width, *extra_dim)
    result = None
    if pctx.is_last_stage:
        result = torch.zeros(shape, dtype=torch.float32)
        for mb, info in zip(microbatches, infos):
            out, n = info["out"], int(mb["real"].sum())
            result[mb["rows"][:n], : out.shape[1]] = out[:n]
    if broadcast and pctx.pp_size > 1:
        device = model_device(chunks)  # NCCL broadcasts device tensors only
        buf = result.to(device) if result is not None else torch.empty(shape, dtype=torch.float32, device=device)
        src = torch.distributed.get_global_rank(pctx.pp_group, pctx.pp_size - 1)
        torch.distributed.broadcast(buf, src=src, group=pctx.pp_group)
        result = buf.cpu()
    return result
