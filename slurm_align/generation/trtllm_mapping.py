"""megatron-core (full state dict, TP=1 naming) -> TensorRT-LLM GPT checkpoint weights, pure torch.

Runs anywhere (no tensorrt_llm import): the TensorRT-LLM engine uses it on GPUs, the tests on
CPU. Names follow TensorRT-LLM's GPTForCausalLM checkpoint (../shared/TRTLLM.md, table A):

    embedding.word_embeddings.weight      -> transformer.vocab_embedding.weight  (rows < vocab)
    embedding.position_embeddings.weight  -> transformer.position_embedding.weight
    decoder.layers.N.input_layernorm.*    -> transformer.layers.N.input_layernorm.*
    ...self_attention.linear_qkv.*        -> transformer.layers.N.attention.qkv.*  (regrouped)
    ...self_attention.linear_proj.*       -> transformer.layers.N.attention.dense.*
    ...pre_mlp_layernorm.*                -> transformer.layers.N.post_layernorm.*
    ...mlp.linear_fc1.* / linear_fc2.*    -> transformer.layers.N.mlp.fc.* / mlp.proj.*
    decoder.final_layernorm.*             -> transformer.ln_f.*
    output_layer.weight                   -> lm_head.weight  (rows < vocab, padded to a TP multiple)

QKV: megatron's rows are grouped per head as [q_h, k_h, v_h]; TensorRT-LLM wants [Q; K; V]
(all query heads, then keys, then values), and each TP rank holds its heads' slice of each.
Column-parallel weights split on rows, row-parallel ones (dense, mlp.proj) on columns; their
biases stay whole. Embeddings stay whole on every rank (no parallel embedding).
"""

from __future__ import annotations

import re

import torch

from slurm_align.generation.params import GenerationError, GptShape

_LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight",
    "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.linear_proj.weight": "attention.dense.weight",
    "self_attention.linear_proj.bias": "attention.dense.bias",
    "pre_mlp_layernorm.weight": "post_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.fc.weight",
    "mlp.linear_fc1.bias": "mlp.fc.bias",
    "mlp.linear_fc2.weight": "mlp.proj.weight",
    "mlp.linear_fc2.bias": "mlp.proj.bias",
}
_GLOBAL_MAP = {
    "embedding.word_embeddings.weight": "transformer.vocab_embedding.weight",
    "embedding.position_embeddings.weight": "transformer.position_embedding.weight",
    "decoder.final_layernorm.weight": "transformer.ln_f.weight",
    "decoder.final_layernorm.bias": "transformer.ln_f.bias",
    "output_layer.weight": "lm_head.weight",
}
# Row-parallel in TensorRT-LLM: weight split on the input dim, bias kept whole.
_ROW_PARALLEL = ("attention.dense.weight", "mlp.proj.weight")
_COLUMN_PARALLEL = ("mlp.fc.weight", "mlp.fc.bias")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_TRT_LAYER_RE = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")


def trtllm_name(mcore_name: str) -> str:
    m = _LAYER_RE.match(mcore_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"transformer.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    if mcore_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[mcore_name]
    raise GenerationError(f"no TensorRT-LLM name for megatron weight {mcore_name!r}")


def mcore_name(trt_name: str) -> str:
    inv_layer = {v: k for k, v in _LAYER_MAP.items()}
    inv_global = {v: k for k, v in _GLOBAL_MAP.items()}
    m = _TRT_LAYER_RE.match(trt_name)
    if m and m.group(2) in inv_layer:
        return f"decoder.layers.{m.group(1)}.{inv_layer[m.group(2)]}"
    if trt_name in inv_global:
        return inv_global[trt_name]
    raise GenerationError(f"no megatron name for TensorRT-LLM weight {trt_name!r}")


def qkv_grouped_to_stacked(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron [heads*(q,k,v)*d, ...] -> (Q, K, V), each [heads*d, ...] (weight or bias)."""
    g = t.reshape(heads, 3, t.shape[0] // (3 * heads), *t.shape[1:])
    return (g[:, i].reshape(-1, *t.shape[1:]) for i in range(3))


def qkv_stacked_to_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    parts = [x.reshape(heads, 1, x.shape[0] // heads, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, 1).reshape(-1, *q.shape[1:])


def lm_head_rows(shape: GptShape, tp_size: int) -> int:
    """lm_head rows in the engine: the real vocab rounded up to a multiple of TP (TRT-LLM's
    pad_vocab_size); the extra rows are zeros."""
    return -(-shape.vocab_size // tp_size) * tp_size


def megatron_to_trtllm(full: dict[str, torch.Tensor], shape: GptShape, *, tp_size: int = 1,
                       tp_rank: int = 0, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """TensorRT-LLM weights of TP rank `tp_rank` (contiguous tensors) from a full state dict."""
    if shape.num_attention_heads % tp_size:
        raise GenerationError(f"tensor_parallel={tp_size} must divide num_attention_heads={shape.num_attention_heads}")
    out: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if name.endswith("_extra_state"):
            continue
        key = trtllm_name(name)
        t = t.detach()
        if key.endswith("attention.qkv.weight") or key.endswith("attention.qkv.bias"):
            q, k, v = qkv_grouped_to_stacked(t, shape.num_attention_heads)
            t = torch.cat([x.chunk(tp_size, 0)[tp_rank] for x in (q, k, v)])
        elif key.endswith(_ROW_PARALLEL):
            t = t.chunk(tp_size, 1)[tp_rank]
        elif key.endswith(_COLUMN_PARALLEL):
            t = t.chunk(tp_size, 0)[tp_rank]
        elif key == "transformer.vocab_embedding.weight":
            t = t[: shape.vocab_size]
        elif key == "lm_head.weight":
            rows = lm_head_rows(shape, tp_size)
            t = torch.cat([t[: shape.vocab_size], t.new_zeros(rows - shape.vocab_size, t.shape[1])])
            t = t.chunk(tp_size, 0)[tp_rank]
        out[key] = t.to(dtype or t.dtype).contiguous()
    return out


def trtllm_to_megatron(shards: list[dict[str, torch.Tensor]], shape: GptShape) -> dict[str, torch.Tensor]:
    """The inverse (for checks): TP shards in rank order -> full state dict; vocab padding rows
    (never used) come back as zeros."""
    tp = len(shards)
    out: dict[str, torch.Tensor] = {}
    for key in shards[0]:
        parts = [s[key] for s in shards]
        if key.endswith("attention.qkv.weight") or key.endswith("attention.qkv.bias"):
            qkv = [p.chunk(3, 0) for p in parts]
            q, k, v = (torch.cat([x[i] for x in qkv]) for i in range(3))
            t = qkv_stacked_to_grouped(q, k, v, shape.num_attention_heads)
        elif key.endswith(_ROW_PARALLEL):
            t = torch.cat(parts, 1)
        elif key.endswith(_COLUMN_PARALLEL) or key == "lm_head.weight":
            t = torch.cat(parts, 0)
        else:
            t = parts[0]
        if key in ("transformer.vocab_embedding.weight", "lm_head.weight"):
            t = torch.cat([t[: shape.vocab_size], t.new_zeros(shape.padded_vocab_size - shape.vocab_size, t.shape[1])])
        out[mcore_name(key)] = t
    del tp
    return out
