"""The model's forward in plain torch, equal to megatron-core's GPTModel (local spec).

Embedding = word (+ learned absolute position); per layer: norm -> fused QKV (rows grouped per
query group as [q_1..q_r, k, v], megatron's layout; r = heads / groups, 1 without GQA) ->
a norm over each head's q and k (qk_layernorm: Qwen3) -> RoPE on q and k (rope models) -> causal
softmax attention (scale 1/sqrt(d)) -> output projection
-> residual; norm -> fc1 -> activation (GELU, tanh-GELU, or SwiGLU on fc1's [gate; up]) -> fc2
-> residual (MoE: each token through its top-k experts, weighted by the router); final norm;
output layer (the word embedding when tied, no bias). Norms are
LayerNorm or RMSNorm; absent biases are None. Two entry points: a full forward over a padded
batch (prefill, the naive engine) and a one-token decode step against a KV cache that holds
`query_groups` heads (GQA keys/values are never expanded to all heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slurm_align.generation.params import GptShape
from slurm_align.generation.rope import apply_rope, cos_sin
from slurm_align.generation.weights import EMBEDDING, POSITIONS, GptWeights, LayerWeights

# Below this many elements LayerNorm runs as plain tensor ops: ATen's layer_norm kernel splits
# even a [32, 256] decode input across threads, and that barrier dominates decode on a busy
# machine; the small ops below run on one thread (same result to ~1e-6).
_SMALL_LN = 1 << 15


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() > _SMALL_LN:
        return F.layer_norm(x, x.shape[-1:], w, b, eps)
    xc = x - x.mean(-1, keepdim=True)
    return torch.addcmul(b, xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps), w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, as transformers' LlamaRMSNorm (float32)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def norm(s: GptShape, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if s.normalization == "RMSNorm":
        return rms_norm(x, w, s.layernorm_epsilon)
    return layer_norm(x, w, b, s.layernorm_epsilon)


def _act(s: GptShape, h: torch.Tensor) -> torch.Tensor:
    if s.activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh" if s.activation == "gelu_tanh" else "none")


def route(s: GptShape, x: torch.Tensor, router_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing as megatron's TopKRouter (fp32): (weights [N, k], expert ids [N, k]) of tokens
    x [N, h]. moe_norm_topk_prob: softmax over the top-k logits; else the top-k of a softmax over
    all experts. Ties between equal logits pick the lower expert id, as torch.topk does."""
    logits = F.linear(x.float(), router_w.float())
    if s.moe_norm_topk_prob:
        top, ids = logits.topk(s.moe_router_topk, dim=-1)
        return top.softmax(-1), ids
    return logits.softmax(-1).topk(s.moe_router_topk, dim=-1)


def _moe(s: GptShape, h: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """Each token through its top-k experts, weighted; each expert runs once on its tokens."""
    flat = h.reshape(-1, h.shape[-1])
    weights, ids = route(s, flat, lw.router_w)
    out = torch.zeros_like(flat)
    for e, (fc1, fc2) in enumerate(lw.experts):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        y = F.linear(_act(s, F.linear(flat[rows], fc1)), fc2)
        out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1).to(y.dtype))
    return out.view_as(h)


def _mlp(s: GptShape, x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    h = norm(s, x, lw.ln2_w, lw.ln2_b)
    if lw.experts is not None:
        return _moe(s, h, lw)
    return F.linear(_act(s, F.linear(h, lw.fc1_w, lw.fc1_b)), lw.fc2_w, lw.fc2_b)


def _qk_norm(s: GptShape, q: torch.Tensor, k: torch.Tensor, lw: LayerWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_layernorm (Qwen3): each head's q and k normed over head_dim, before RoPE."""
    if lw.q_norm_w is None:
        return q, k
    return norm(s, q, lw.q_norm_w, lw.q_norm_b), norm(s, k, lw.k_norm_w, lw.k_norm_b)


def _embed(w: GptWeights, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = F.embedding(tokens, w[EMBEDDING])
    if w.shape.position_embedding == "learned":
        x = x + F.embedding(positions, w[POSITIONS])
    return x


def _rope_at(w: GptWeights, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin for these positions [B, T] as [B, 1, T, d] (broadcast over heads); None without rope."""
    if w.inv_freq is None:
        return None
    cos, sin = cos_sin(positions, w.inv_freq)
    return cos.unsqueeze(1).to(w.dtype), sin.unsqueeze(1).to(w.dtype)


def _split_qkv(s: GptShape, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, rows] in megatron layout -> q [B, heads, T, d], k and v [B, groups, T, d]
    (strided views without GQA, no copy)."""
    b, t, _ = qkv.shape
    g, d = s.query_groups, s.head_dim
    r = s.num_attention_heads // g
    x = qkv.view(b, t, g, r + 2, d).permute(3, 0, 2, 1, 4)   # [r+2, B, g, T, d]
    q = x[0] if r == 1 else x[:r].permute(1, 2, 0, 3, 4).reshape(b, g * r, t, d)
    return q, x[r], x[r + 1]


def attention_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, T, T] (True = attend): causal, padded keys excluded.

    Each query may always see itself, so rows of padding queries are never fully masked
    (an all-masked row is NaN); their outputs are unused.
    """
    t = key_valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=key_valid.device).tril()
    mask = causal & key_valid[:, None, :]
    return (mask | torch.eye(t, dtype=torch.bool, device=key_valid.device))[:, None]


def _final(w: GptWeights, x: torch.Tensor) -> torch.Tensor:
    x = norm(w.shape, x, w["decoder.final_layernorm.weight"], w.tensors.get("decoder.final_layernorm.bias"))
    return F.linear(x, w.output)


def forward_full(w: GptWeights, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                 *, last_only: bool = False, kv_out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a padded batch: tokens/positions [B, T] int64, key_valid [B, T] bool.

    last_only: logits of the last column only ([B, V]); else [B, T, V].
    kv_out: a KV cache [L, 2, B, groups, S, d] (S >= T): this call's keys (after RoPE) and
    values land in kv_out[:, :, :, :, :T] (the prefill of the KV-cache engine).
    """
    s = w.shape
    x = _embed(w, tokens, positions)
    rope = _rope_at(w, positions)
    mask = attention_mask(key_valid)
    gqa = s.query_groups != s.num_attention_heads
    t = tokens.shape[1]
    for i, lw in enumerate(w.layers):
        h = norm(s, x, lw.ln1_w, lw.ln1_b)
        q, k, v = _split_qkv(s, F.linear(h, lw.qkv_w, lw.qkv_b))
        q, k = _qk_norm(s, q, k, lw)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_out is not None:
            kv_out[i, 0, :, :, :t].copy_(k)
            kv_out[i, 1, :, :, :t].copy_(v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        x = x + F.linear(a.transpose(1, 2).reshape(*x.shape[:2], -1), lw.proj_w, lw.proj_b)
        x = x + _mlp(s, x, lw)
    if last_only:
        x = x[:, -1]
    return _final(w, x)


def decode_step(w: GptWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                slot: int, key_bias: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: tokens/positions [B]; its K/V go to cache column `slot`;
    attention covers columns [0, slot] with additive key_bias [B, 1, 1, >= slot+1]
    (0 = attend, -inf = padding). Returns logits [B, V].

    The r = heads / groups queries of one group attend as r rows against that group's cached
    keys ([B, groups, r, d] queries), so the cache is read once per group, never expanded."""
    s = w.shape
    b, g, d = tokens.shape[0], s.query_groups, s.head_dim
    r = s.num_attention_heads // g
    x = _embed(w, tokens, positions).unsqueeze(1)
    rope = _rope_at(w, positions.unsqueeze(1))   # [B, 1, 1, d]: broadcast over groups and rows
    bias = key_bias[..., : slot + 1]
    for i, lw in enumerate(w.layers):
        h = norm(s, x, lw.ln1_w, lw.ln1_b)
        qkv = F.linear(h, lw.qkv_w, lw.qkv_b).view(b, g, r + 2, d)
        q, k, v = qkv[:, :, :r], qkv[:, :, r: r + 1], qkv[:, :, r + 1:]
        q, k = _qk_norm(s, q, k, lw)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        kv[i, 0, :, :, slot: slot + 1].copy_(k)
        kv[i, 1, :, :, slot: slot + 1].copy_(v)
        a = F.scaled_dot_product_attention(q, kv[i, 0, :, :, : slot + 1], kv[i, 1, :, :, : slot + 1],
                                           attn_mask=bias)
        x = x + F.linear(a.reshape(b, 1, -1), lw.proj_w, lw.proj_b)
        x = x + _mlp(s, x, lw)
    return _final(w, x[:, 0])
