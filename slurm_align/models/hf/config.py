"""HF config.json <-> ModelConfig fields, for Llama, Qwen2, Qwen3, Mistral and GPT-2.

Reads and writes JSON only (no torch): `ModelConfig` calls `fill_model_fields` while it
validates a run config with `model.hf_path` set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slurm_align.config.errors import ConfigError

# architectures entry of config.json -> model_type (*ForSequenceClassification: a `score` head).
SUPPORTED = {
    "LlamaForCausalLM": "llama", "LlamaForSequenceClassification": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
    "MistralForCausalLM": "mistral", "MistralForSequenceClassification": "mistral",
    "GPT2LMHeadModel": "gpt2", "GPT2ForSequenceClassification": "gpt2",
}
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
             "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}
# Fields a folder determines; a run config that gives one of them differently is refused.
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
               "position_embedding", "rotary_base", "rope_scaling", "normalization", "norm_epsilon",
               "activation", "num_query_groups", "kv_channels", "add_bias_linear", "add_qkv_bias",
               "tie_embeddings", "qk_layernorm", "num_experts", "moe_router_topk", "moe_norm_topk_prob")


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise ConfigError([f"model.hf_path: {folder} is not a folder"], folder)
    if not path.is_file():
        raise ConfigError([f"no config.json in the Hugging Face model folder {folder}"], path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError([f"not valid JSON ({e})"], path) from None


def architecture(hf: dict, source: Path) -> tuple[str, str]:
    """(architectures entry, model_type); unsupported ones are a ConfigError listing ours."""
    archs = hf.get("architectures") or [CAUSAL_LM.get(hf.get("model_type", ""), str(hf.get("model_type")))]
    arch = archs[0]
    if arch not in SUPPORTED:
        raise ConfigError([f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}"], source)
    return arch, SUPPORTED[arch]


def _rope(hf: dict, source: Path) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older files rope_scaling.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"position_embedding": "rope", "rotary_base": theta, "rope_scaling": None}
    if kind == "llama3":
        out["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                    "original_max_position_embeddings")}
    elif kind != "default":
        raise ConfigError([f"rope type {kind!r} is not supported; supported: default, llama3"], source)
    return out


def _llama_like(hf: dict, model_type: str, source: Path) -> dict[str, Any]:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError([f"hidden_act {hf['hidden_act']!r} is not supported; supported: silu"], source)
    heads = hf["num_attention_heads"]
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise ConfigError(["use_sliding_window=true is not supported (sliding-window attention)"], source)
    if model_type == "qwen2":
        qkv_bias, all_bias = True, False
    elif model_type in ("qwen3", "qwen3_moe"):
        # Qwen3: attention_bias puts biases on q, k, v and o; its MLP never has one.
        if attn_bias:
            raise ConfigError(["attention_bias=true is not supported for Qwen3 (a bias on o_proj "
                               "without one on the MLP); supported: false"], source)
        qkv_bias, all_bias = False, False
    elif attn_bias != mlp_bias:
        raise ConfigError([f"attention_bias={attn_bias} with mlp_bias={mlp_bias} is not supported; "
                           "supported: both false or both true"], source)
    else:
        qkv_bias, all_bias = False, attn_bias
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    moe = _moe(hf, model_type, source)
    return {
        "num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads, "ffn_hidden_size": hf["intermediate_size"],
        **moe,
        "vocab_size": hf["vocab_size"], **_rope(hf, source),
        "normalization": "RMSNorm", "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu", "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": head_dim, "add_bias_linear": all_bias, "add_qkv_bias": qkv_bias,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        # Qwen3: RMSNorm over each head's q and k (before RoPE), weights of head_dim.
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
    }


def _moe(hf: dict, model_type: str, source: Path) -> dict[str, Any]:
    """MoE fields: experts, top-k and its normalisation; the expert width is ffn_hidden_size."""
    if model_type == "mixtral":
        return {"num_experts": hf["num_local_experts"], "moe_router_topk": hf["num_experts_per_tok"],
                "moe_norm_topk_prob": True}  # softmax over the top-k logits
    if model_type != "qwen3_moe":
        return {"num_experts": None, "moe_router_topk": 2, "moe_norm_topk_prob": True}
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError([f"mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
                           f"{hf.get('decoder_sparse_step')} (dense layers between MoE layers) are not supported; "
                           "supported: every layer MoE (mlp_only_layers=[], decoder_sparse_step=1)"], source)
    # the Hub's Qwen3-MoE files say num_experts; transformers >= 5 writes num_local_experts
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    return {"num_experts": experts, "moe_router_topk": hf["num_experts_per_tok"],
            "ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _gpt2(hf: dict, source: Path) -> dict[str, Any]:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ConfigError([f"{flag}=true is not supported"], source)
    if hf.get("scale_attn_weights") is False:
        raise ConfigError(["scale_attn_weights=false is not supported"], source)
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(
        hf.get("activation_function", "gelu_new"))
    if act is None:
        raise ConfigError([f"activation_function {hf['activation_function']!r} is not supported; "
                           "supported: gelu_new, gelu_pytorch_tanh, gelu"], source)
    hidden = hf["n_embd"]
    return {
        "num_layers": hf["n_layer"], "hidden_size": hidden, "num_attention_heads": hf["n_head"],
        "ffn_hidden_size": hf.get("n_inner") or 4 * hidden, "vocab_size": hf["vocab_size"],
        "position_embedding": "learned", "rotary_base": 10000.0, "rope_scaling": None,
        "normalization": "LayerNorm", "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
        "activation": act, "num_query_groups": None, "kv_channels": None,
        "add_bias_linear": True, "add_qkv_bias": False,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "qk_layernorm": False, "num_experts": None, "moe_router_topk": 2, "moe_norm_topk_prob": True,
    }


def max_positions(hf: dict, model_type: str) -> int:
    """Longest sequence the HF model handles as trained (Mistral: its sliding window)."""
    if model_type == "gpt2":
        return int(hf.get("n_positions", 1024))
    limit = int(hf.get("max_position_embeddings", 2048))
    if model_type in ("mistral", "mixtral") and hf.get("sliding_window"):
        limit = min(limit, int(hf["sliding_window"]))
    return limit


def model_fields(hf: dict, source: Path) -> dict[str, Any]:
    """ModelConfig fields (architecture, shape, vocab) of an HF config.json's contents."""
    _, model_type = architecture(hf, source)
    try:
        return _gpt2(hf, source) if model_type == "gpt2" else _llama_like(hf, model_type, source)
    except KeyError as e:
        raise ConfigError([f"key {e.args[0]!r} is missing (needed for a {model_type} model)"], source) from None


def fill_model_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The raw `model` section with the fields of its hf_path folder filled in. A field the
    user gave with another value than the folder's is a ConfigError (it would not load)."""
    folder = Path(data["hf_path"])
    source = folder / "config.json"
    hf = read_hf_config(folder)
    fields = model_fields(hf, source)
    problems = []
    for key in ARCH_FIELDS:
        if key in data and data[key] is not None and key not in ("rope_scaling",):
            given, want = data[key], fields[key]
            if given != want and not (isinstance(want, float) and float(given) == want):
                problems.append(f"model.{key}={given!r} conflicts with the folder's value {want!r} "
                                "(leave it out to take the folder's)")
    if problems:
        raise ConfigError(problems, source)
    arch = architecture(hf, source)[0]
    limit = max_positions(hf, SUPPORTED[arch])
    out = {**data, **fields}
    if arch.endswith("ForSequenceClassification"):   # a reward model: its score head's outputs
        labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 1))
        if data.get("num_labels") not in (None, labels):
            raise ConfigError([f"model.num_labels={data['num_labels']!r} conflicts with the folder's {labels} "
                               "label(s) (leave it out to take the folder's)"], source)
        out["num_labels"] = labels
    if fields.get("num_experts") is not None and data.get("moe_aux_loss_coeff") is None:
        out["moe_aux_loss_coeff"] = float(hf.get("router_aux_loss_coef", 0.0))
    if data.get("max_seq_len") is None:
        out["max_seq_len"] = limit
    elif int(data["max_seq_len"]) > limit:
        raise ConfigError([f"model.max_seq_len={data['max_seq_len']} exceeds the model's {limit} positions"], source)
    if data.get("tokenizer") is None and (folder / "tokenizer.json").is_file():
        out["tokenizer"] = {"kind": "hf", "path": str(folder / "tokenizer.json")}
    return out


def export_model_type(cfg, source_type: str | None) -> str:
    """The HF model_type a ModelConfig is written as: the source folder's when it came from
    one, otherwise the architecture its fields describe (slurm-align's own GPT is a GPT-2)."""
    if source_type is not None:
        return source_type
    if (cfg.position_embedding, cfg.normalization) == ("learned", "LayerNorm") and cfg.activation != "swiglu" \
            and cfg.add_bias_linear and cfg.query_groups == cfg.num_attention_heads \
            and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size:
        return "gpt2"
    if (cfg.position_embedding, cfg.normalization, cfg.activation) == ("rope", "RMSNorm", "swiglu"):
        if cfg.num_experts is not None and not (cfg.add_qkv_bias or cfg.add_bias_linear):
            return "qwen3_moe" if cfg.qk_layernorm or not cfg.moe_norm_topk_prob else "mixtral"
        if cfg.qk_layernorm:
            if cfg.add_qkv_bias or cfg.add_bias_linear:
                raise ConfigError(["a model with qk_layernorm and biases has no Hugging Face architecture "
                                   "(qwen3 has neither QKV nor MLP biases)"])
            return "qwen3"
        return "qwen2" if cfg.add_qkv_bias and not cfg.add_bias_linear else "llama"
    raise ConfigError([f"model with position_embedding={cfg.position_embedding}, normalization="
                       f"{cfg.normalization}, activation={cfg.activation} has no Hugging Face "
                       "architecture among: gpt2 (learned, LayerNorm, gelu/gelu_tanh, biases), "
                       "llama/qwen2/qwen3/mistral (rope, RMSNorm, swiglu)"])


def hf_config_dict(cfg, model_type: str, base: dict[str, Any] | None = None,
                   value_head: bool = False) -> dict[str, Any]:
    """config.json of a ModelConfig written as `model_type` (the inverse of model_fields).
    `base`, the source folder's config.json, keeps token ids and anything else we do not own."""
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_parameters")}
    arch = CAUSAL_LM[model_type]
    if value_head:
        arch = next(a for a, t in SUPPORTED.items() if t == model_type and a.endswith("ForSequenceClassification"))
        out["num_labels"] = cfg.num_labels
        out.pop("id2label", None)
        out.pop("label2id", None)
    out.update({"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
                "tie_word_embeddings": cfg.tie_embeddings, "dtype": "float32"})
    if model_type == "gpt2":
        out.update({"n_layer": cfg.num_layers, "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads,
                    "n_inner": cfg.ffn, "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_epsilon,
                    "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu"}[cfg.activation]})
        return out
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    # Both keys: transformers >= 5 reads rope_parameters (rope_theta inside); transformers 4.x
    # (TensorRT-LLM 1.2.1 pins 4.57.3, and other readers of an exported folder) reads only
    # rope_scaling (null: plain RoPE) and rope_theta: without it Llama-3 scaling is silently lost.
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **cfg.rope_scaling.model_dump()}
        rope.update(scaling)
    out.update({"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.query_groups,
                "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn, "hidden_act": "silu",
                "rms_norm_eps": cfg.norm_epsilon, "rope_parameters": rope, "rope_scaling": scaling,
                "rope_theta": cfg.rotary_base,
                "max_position_embeddings": out.get("max_position_embeddings", cfg.max_seq_len)})
    if model_type in ("llama", "mistral"):
        out.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    if model_type in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=False, use_sliding_window=False)
    if model_type == "qwen3_moe":
        out.update(moe_intermediate_size=cfg.ffn, num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   norm_topk_prob=cfg.moe_norm_topk_prob, router_aux_loss_coef=cfg.moe_aux_loss_coeff,
                   mlp_only_layers=[], decoder_sparse_step=1,
                   intermediate_size=(base or {}).get("intermediate_size", cfg.ffn))
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   router_aux_loss_coef=cfg.moe_aux_loss_coeff)
    return out
