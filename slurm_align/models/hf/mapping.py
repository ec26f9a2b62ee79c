"""Tensor names and layouts between megatron's full state dict (weights.py naming) and HF files.

Every megatron tensor is described by a `Source`: the HF tensors it is made of and how. Both
directions use the same table: `fill_shard` fills one TP rank's slice of a megatron tensor, reading
only the HF rows/columns it needs; `to_hf` splits a full megatron tensor into HF tensors.

Layouts:
- plain:   the same tensor (conv1d=True: GPT-2's Conv1D stores the transpose, [in, out]);
- rows:    the first rows of a replicated tensor (GPT-2 positions when max_seq_len < n_positions);
- vocab:   embedding / output rows; megatron pads vocab_size up (ModelConfig.padded_vocab_size);
- glu:     SwiGLU fc1 = [gate; up] (hf = gate, up), also each MoE expert's;
- qkv:     megatron groups the fused QKV per key/value head: [q_1..q_n, k, v] per group, each
           head_dim rows (hf = q, k, v as separate tensors, or one GPT-2 c_attn with q|k|v);
- zeros:   no HF counterpart (the value head's bias when the head is an HF `score`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slurm_align.config.run import ModelConfig

# reader(hf_name, dim, start, stop) -> the HF tensor's [start:stop) along dim (None: all of it)
Reader = Callable[[str, int | None, int, int], torch.Tensor]


@dataclass(frozen=True)
class Source:
    kind: str  # plain | vocab | glu | qkv | zeros
    hf: tuple[str, ...] = ()
    conv1d: bool = False  # HF stores [in, out] (GPT-2 Conv1D)


# MoE block of an HF layer: (module prefix, router, expert gate / up / down projection names).
_MOE_NAMES = {"qwen3_moe": ("mlp.", "gate", ("gate_proj", "up_proj", "down_proj")),
              "mixtral": ("block_sparse_moe.", "gate", ("w1", "w3", "w2"))}


def _moe_mlp(i: int, cfg: ModelConfig, model_type: str) -> dict[str, Source]:
    """megatron's MoE layer (router + SequentialMLP experts by global index) from the HF
    router and per-expert projections (fc1 = [gate; up] as in the dense MLP)."""
    assert cfg.num_experts is not None, "called for MoE models only"
    block, router, (gate, up, down) = _MOE_NAMES[model_type]
    hf, mg = f"model.layers.{i}.{block}", f"decoder.layers.{i}.mlp."
    out = {mg + "router.weight": Source("plain", (hf + f"{router}.weight",))}
    for e in range(cfg.num_experts):
        x, m = hf + f"experts.{e}.", mg + f"experts.local_experts.{e}."
        out[m + "linear_fc1.weight"] = Source("glu", (x + f"{gate}.weight", x + f"{up}.weight"))
        out[m + "linear_fc2.weight"] = Source("plain", (x + f"{down}.weight",))
    return out


def _llama_layer(i: int, cfg: ModelConfig, model_type: str) -> dict[str, Source]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    out = {
        mg + "input_layernorm.weight": Source("plain", (hf + "input_layernorm.weight",)),
        mg + "self_attention.linear_qkv.weight": Source(
            "qkv", tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv")),
        mg + "self_attention.linear_proj.weight": Source("plain", (hf + "self_attn.o_proj.weight",)),
        mg + "pre_mlp_layernorm.weight": Source("plain", (hf + "post_attention_layernorm.weight",)),
    }
    if cfg.num_experts is not None:
        out.update(_moe_mlp(i, cfg, model_type))
    else:
        out[mg + "mlp.linear_fc1.weight"] = Source("glu", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"))
        out[mg + "mlp.linear_fc2.weight"] = Source("plain", (hf + "mlp.down_proj.weight",))
    if cfg.qk_layernorm:  # Qwen3's per-head q/k RMSNorm (head_dim weights, replicated over TP)
        out[mg + "self_attention.q_layernorm.weight"] = Source("plain", (hf + "self_attn.q_norm.weight",))
        out[mg + "self_attention.k_layernorm.weight"] = Source("plain", (hf + "self_attn.k_norm.weight",))
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        out[mg + "self_attention.linear_qkv.bias"] = Source(
            "qkv", tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"))
    if cfg.add_bias_linear:
        out[mg + "self_attention.linear_proj.bias"] = Source("plain", (hf + "self_attn.o_proj.bias",))
        out[mg + "mlp.linear_fc1.bias"] = Source("glu", (hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias"))
        out[mg + "mlp.linear_fc2.bias"] = Source("plain", (hf + "mlp.down_proj.bias",))
    return out


def _gpt2_layer(i: int) -> dict[str, Source]:
    hf, mg = f"transformer.h.{i}.", f"decoder.layers.{i}."
    out = {}
    for part in ("weight", "bias"):
        conv = part == "weight"
        out.update({
            mg + f"input_layernorm.{part}": Source("plain", (hf + f"ln_1.{part}",)),
            mg + f"self_attention.linear_qkv.{part}": Source("qkv", (hf + f"attn.c_attn.{part}",), conv),
            mg + f"self_attention.linear_proj.{part}": Source("plain", (hf + f"attn.c_proj.{part}",), conv),
            mg + f"pre_mlp_layernorm.{part}": Source("plain", (hf + f"ln_2.{part}",)),
            mg + f"mlp.linear_fc1.{part}": Source("plain", (hf + f"mlp.c_fc.{part}",), conv),
            mg + f"mlp.linear_fc2.{part}": Source("plain", (hf + f"mlp.c_proj.{part}",), conv),
        })
    return out


def sources(cfg: ModelConfig, model_type: str, *, value_head: bool, score_head: bool) -> dict[str, Source]:
    """megatron full name -> Source, in the TP=1, PP=1 model's order. `value_head`: the model
    has a scalar head; `score_head`: it comes from the HF `score` (otherwise it stays fresh)."""
    gpt2 = model_type == "gpt2"
    out: dict[str, Source] = {}
    out["embedding.word_embeddings.weight"] = Source(
        "vocab", ("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight",))
    if cfg.position_embedding == "learned":
        out["embedding.position_embeddings.weight"] = Source("rows", ("transformer.wpe.weight",))
    for i in range(cfg.num_layers):
        out.update(_gpt2_layer(i) if gpt2 else _llama_layer(i, cfg, model_type))
    final = "transformer.ln_f." if gpt2 else "model.norm."
    out["decoder.final_layernorm.weight"] = Source("plain", (final + "weight",))
    if cfg.normalization == "LayerNorm":
        out["decoder.final_layernorm.bias"] = Source("plain", (final + "bias",))
    if value_head:
        if score_head:
            out["value_head.weight"] = Source("plain", ("score.weight",))
            out["value_head.bias"] = Source("zeros")
    elif not cfg.tie_embeddings:
        out["output_layer.weight"] = Source("vocab", ("lm_head.weight",))
    return out


def _qkv_rows(cfg: ModelConfig, model_type: str) -> tuple[int, int]:
    """(rows of q per group, rows of k (= of v) per group)."""
    per_group = cfg.num_attention_heads // cfg.query_groups
    return per_group * cfg.head_dim, cfg.head_dim


@torch.no_grad()
def fill_shard(out: torch.Tensor, src: Source, cfg: ModelConfig, model_type: str, read: Reader,
               dim: int | None, tp_size: int, tp_rank: int) -> None:
    """Copy into `out` this TP rank's slice (partitioned along megatron `dim`; None: replicated)
    of the megatron tensor described by `src`, reading only the HF rows/columns it needs. Slices
    are copied straight into `out` (converting dtype there), so the only temporary is one slice
    in the file's dtype."""
    shape = tuple(out.shape)
    n = shape[dim] if dim is not None else None
    start = tp_rank * n if n is not None else 0

    def rows(name: str, a: int, b: int) -> torch.Tensor:
        # megatron rows (dim 0) [a, b) of an HF tensor, transposing GPT-2's Conv1D weights
        return read(name, 1, a, b).t() if src.conv1d else read(name, 0, a, b)

    if src.kind == "zeros":
        out.zero_()
    elif src.kind == "plain":
        if dim is None:
            t = read(src.hf[0], None, 0, 0)
        else:
            t = read(src.hf[0], 1 - dim if src.conv1d else dim, start, start + shape[dim])
        out.copy_(t.t() if src.conv1d else t)
    elif src.kind == "rows":
        out.copy_(read(src.hf[0], 0, 0, shape[0]))
    elif src.kind == "vocab":
        stop = min(start + shape[0], cfg.vocab_size)
        if stop > start:
            out[: stop - start].copy_(read(src.hf[0], 0, start, stop))
        out[max(stop - start, 0):].zero_()
    elif src.kind == "glu":
        half = shape[0] // 2
        for i, name in enumerate(src.hf):
            out[i * half:(i + 1) * half].copy_(read(name, 0, tp_rank * half, (tp_rank + 1) * half))
    elif src.kind == "qkv":
        q_rows, kv_rows = _qkv_rows(cfg, model_type)
        groups = cfg.query_groups // tp_size
        g0 = tp_rank * groups
        # GPT-2's c_attn holds q | k | v along its output dim, hidden_size each
        names = src.hf if len(src.hf) == 3 else src.hf * 3
        h = 0 if len(src.hf) == 3 else cfg.num_attention_heads * cfg.head_dim
        grouped = out.view(groups, q_rows + 2 * kv_rows, *shape[1:])
        q = rows(names[0], g0 * q_rows, (g0 + groups) * q_rows)
        grouped[:, :q_rows].copy_(q.reshape(groups, q_rows, *shape[1:]))
        for i, offset in ((1, h), (2, 2 * h)):
            kv = rows(names[i], offset + g0 * kv_rows, offset + (g0 + groups) * kv_rows)
            lo = q_rows + (i - 1) * kv_rows
            grouped[:, lo:lo + kv_rows].copy_(kv.reshape(groups, kv_rows, *shape[1:]))
    else:
        raise ValueError(f"unknown layout {src.kind!r}")


def read_shard(src: Source, cfg: ModelConfig, model_type: str, read: Reader, shape: tuple[int, ...],
               dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """fill_shard into a new float32 tensor of `shape`."""
    out = torch.empty(shape)
    fill_shard(out, src, cfg, model_type, read, dim, tp_size, tp_rank)
    return out


def to_hf(src: Source, full: torch.Tensor, cfg: ModelConfig, model_type: str) -> dict[str, torch.Tensor]:
    """HF tensors from a full megatron tensor (the inverse of fill_shard at TP=1)."""
    def hf_layout(t: torch.Tensor) -> torch.Tensor:
        return (t.t() if src.conv1d and t.dim() == 2 else t).contiguous()

    if src.kind == "zeros":
        return {}
    if src.kind in ("plain", "rows"):
        return {src.hf[0]: hf_layout(full)}
    if src.kind == "vocab":
        return {src.hf[0]: full[: cfg.vocab_size].contiguous()}
    if src.kind == "glu":
        gate, up = full.chunk(2, dim=0)
        return {src.hf[0]: gate.contiguous(), src.hf[1]: up.contiguous()}
    if src.kind == "qkv":
        q_rows, kv_rows = _qkv_rows(cfg, model_type)
        grouped = full.reshape(cfg.query_groups, q_rows + 2 * kv_rows, *full.shape[1:])
        q, k, v = (grouped[:, :q_rows], grouped[:, q_rows:q_rows + kv_rows], grouped[:, q_rows + kv_rows:])
        q, k, v = (x.reshape(-1, *full.shape[1:]) for x in (q, k, v))
        if len(src.hf) == 3:
            return {name: x.contiguous() for name, x in zip(src.hf, (q, k, v))}
        return {src.hf[0]: hf_layout(torch.cat([q, k, v], dim=0))}
    raise ValueError(f"unknown layout {src.kind!r}")
