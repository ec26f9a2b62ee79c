"""The contract GPT's forward in plain torch, equal to megatron-core's GPTModel (local spec).

Embedding = word + learned absolute position; per layer: LayerNorm -> fused QKV (rows grouped
per head as [q, k, v], megatron's layout) -> causal softmax attention (scale 1/sqrt(d)) ->
output projection -> residual; LayerNorm -> fc1 -> exact GELU -> fc2 -> residual; final
LayerNorm; untied output layer (no bias). Two entry points: a full forward over a padded batch
(prefill, the naive engine) and a one-token decode step against a KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slurm_align.generation.weights import GptWeights, LayerWeights


def _split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, 3H] in megatron layout -> q, k, v as [B, heads, T, d] (strided views, no copy)."""
    b, t, three_h = qkv.shape
    x = qkv.view(b, t, heads, 3, three_h // (3 * heads)).permute(3, 0, 2, 1, 4)
    return x[0], x[1], x[2]


# Below this many elements LayerNorm runs as plain tensor ops: ATen's layer_norm kernel splits
# even a [32, 256] decode input across threads, and that barrier dominates decode on a busy
# machine; the small ops below run on one thread (same result to ~1e-6).
_SMALL_LN = 1 << 15


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() > _SMALL_LN:
        return F.layer_norm(x, x.shape[-1:], w, b, eps)
    xc = x - x.mean(-1, keepdim=True)
    return torch.addcmul(b, xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps), w)


def _mlp(x: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
    h = layer_norm(x, lw.ln2_w, lw.ln2_b, eps)
    return F.linear(F.gelu(F.linear(h, lw.fc1_w, lw.fc1_b)), lw.fc2_w, lw.fc2_b)


def attention_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, T, T] (True = attend): causal, padded keys excluded.

    Each query may always see itself, so rows of padding queries are never fully masked
    (an all-masked row is NaN); their outputs are unused.
    """
    t = key_valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=key_valid.device).tril()
    mask = causal & key_valid[:, None, :]
    return (mask | torch.eye(t, dtype=torch.bool, device=key_valid.device))[:, None]


def forward_full(w: GptWeights, tokens: torch.Tensor, positions: torch.Tensor, key_valid: torch.Tensor,
                 *, last_only: bool = False, kv_out: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a padded batch: tokens/positions [B, T] int64, key_valid [B, T] bool.

    last_only: logits of the last column only ([B, V]); else [B, T, V].
    kv_out: a KV cache [L, 2, B, heads, S, d] (S >= T): this call's keys/values land in
    kv_out[:, :, :, :, :T] (the prefill of the KV-cache engine).
    """
    s = w.shape
    x = F.embedding(tokens, w["embedding.word_embeddings.weight"]) + \
        F.embedding(positions, w["embedding.position_embeddings.weight"])
    mask = attention_mask(key_valid)
    t = tokens.shape[1]
    for i, lw in enumerate(w.layers):
        h = layer_norm(x, lw.ln1_w, lw.ln1_b, s.layernorm_epsilon)
        q, k, v = _split_qkv(F.linear(h, lw.qkv_w, lw.qkv_b), s.num_attention_heads)
        if kv_out is not None:
            kv_out[i, 0, :, :, :t].copy_(k)
            kv_out[i, 1, :, :, :t].copy_(v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + F.linear(a.transpose(1, 2).reshape(x.shape), lw.proj_w, lw.proj_b)
        x = x + _mlp(x, lw, s.layernorm_epsilon)
    if last_only:
        x = x[:, -1]
    x = layer_norm(x, w["decoder.final_layernorm.weight"], w["decoder.final_layernorm.bias"],
                   s.layernorm_epsilon)
    return F.linear(x, w["output_layer.weight"])


def decode_step(w: GptWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                slot: int, key_bias: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: tokens/positions [B]; its K/V go to cache column `slot`;
    attention covers columns [0, slot] with additive key_bias [B, 1, 1, >= slot+1]
    (0 = attend, -inf = padding). Returns logits [B, V]."""
    s = w.shape
    x = (F.embedding(tokens, w["embedding.word_embeddings.weight"]) +
         F.embedding(positions, w["embedding.position_embeddings.weight"])).unsqueeze(1)
    bias = key_bias[..., : slot + 1]
    for i, lw in enumerate(w.layers):
        h = layer_norm(x, lw.ln1_w, lw.ln1_b, s.layernorm_epsilon)
        q, k, v = _split_qkv(F.linear(h, lw.qkv_w, lw.qkv_b), s.num_attention_heads)
        kv[i, 0, :, :, slot: slot + 1].copy_(k)
        kv[i, 1, :, :, slot: slot + 1].copy_(v)
        a = F.scaled_dot_product_attention(q, kv[i, 0, :, :, : slot + 1], kv[i, 1, :, :, : slot + 1],
                                           attn_mask=bias)
        x = x + F.linear(a.transpose(1, 2).reshape(x.shape), lw.proj_w, lw.proj_b)
        x = x + _mlp(x, lw, s.layernorm_epsilon)
    x = layer_norm(x[:, 0], w["decoder.final_layernorm.weight"], w["decoder.final_layernorm.bias"],
                   s.layernorm_epsilon)
    return F.linear(x, w["output_layer.weight"])
