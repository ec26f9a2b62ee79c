"""What a generation call takes (SamplingParams, GptShape) and gives back (GenerationOutput)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class GenerationError(ValueError):
    """A generation request the engine cannot serve (too long, empty prompt, bad params).

    The message names the offending sample/field, its value and what is allowed.
    """


def logprob_temperature(temperature: float) -> float:
    """The temperature at which engines and trainer score a policy's tokens: the sampling
    temperature, or 1 for greedy decoding (temperature 0 has no distribution to score)."""
    return temperature if temperature > 0.0 else 1.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens; one set per `generate` call (seeds are per sample, see `generate`)."""

    max_new_tokens: int = 32
    """Response length limit (tokens generated per sample, EOS included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p."""
    eos_id: int | None = None
    """Stop a sample when it emits this token (kept in the response); None never stops early."""
    stop_token_sequences: tuple[tuple[int, ...], ...] = ()
    """Also stop a sample (is_end, the sequence kept) once its response ends with one of these
    token sequences: a multi-turn environment's stop strings, tokenized. The torch engines and
    vLLM (vllm_scheduler.py) stop there; TensorRT-LLM at the one-token ones
    (trtllm_engine.native_stop_ids) and past longer ones, and the caller's cut by text
    (conversations.stop_cut) is exact either way."""
    pad_id: int = 0
    """Fills response_tokens past each sample's length."""
    seed: int = 0
    """Default per-sample seeds are seed + sample index (pass `seeds` to generate() to make a
    sample's draws independent of its position in the batch)."""
    return_logprobs: bool = True
    """Also return each response token's log-probability under the model's distribution at
    this temperature (softmax(logits / temperature); temperature 1 when greedy), before top-k
    and top-p, padding vocab excluded: the policy the trainer scores (its pi_old), so rollout
    correction compares like with like (algorithms/rollout_correction.py)."""

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0.0, ">= 0 (0 = greedy)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = all)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
        ]
        checks.append(("stop_token_sequences", all(len(q) >= 1 for q in self.stop_token_sequences),
                       "non-empty token sequences"))
        for name, ok, allowed in checks:
            if not ok:
                raise GenerationError(f"SamplingParams.{name}={getattr(self, name)!r}: must be {allowed}")

    @property
    def stops_early(self) -> bool:
        """Whether a sample can end before max_new_tokens (EOS or a stop sequence)."""
        return self.eos_id is not None or bool(self.stop_token_sequences)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the returned log-probs: this one, or 1 for greedy decoding."""
        return logprob_temperature(self.temperature)

    @classmethod
    def from_config(cls, gen_cfg: Any, *, eos_id: int | None, pad_id: int = 0, seed: int = 0) -> SamplingParams:
        """From a slurm_align.config.run.GenerationConfig."""
        return cls(max_new_tokens=gen_cfg.max_new_tokens, temperature=gen_cfg.temperature,
                   top_k=gen_cfg.top_k, top_p=gen_cfg.top_p, eos_id=eos_id, pad_id=pad_id, seed=seed)


@dataclass(frozen=True)
class GptShape:
    """The model's architecture, as the engines need it (weights come from a full state dict).

    The defaults are slurm-align's own GPT; the other fields follow ModelConfig (see
    /work/coord/MODEL_FIELDS.md): Llama/Qwen2/Mistral use rope, RMSNorm, swiglu, GQA.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Real vocabulary; logits at or past it are padding and never sampled."""
    padded_vocab_size: int
    max_seq_len: int
    layernorm_epsilon: float = 1e-5
    """Epsilon of every norm (ModelConfig.norm_epsilon)."""
    position_embedding: str = "learned"
    """'learned' absolute positions or 'rope'."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    rope_scaling: Any = None
    """Llama-3 frequency scaling (a RopeScalingConfig: factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) or None."""
    normalization: str = "LayerNorm"
    """'LayerNorm' (weight and bias) or 'RMSNorm' (weight only)."""
    activation: str = "gelu"
    """'gelu' (erf), 'gelu_tanh' or 'swiglu' (fc1 rows are [gate; up])."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); None: one per attention head."""
    kv_channels: int | None = None
    """Head dimension; None: hidden_size // num_attention_heads."""
    add_bias_linear: bool = True
    """Biases in every linear layer."""
    add_qkv_bias: bool = False
    """A bias in the QKV projection (implied by add_bias_linear)."""
    tie_embeddings: bool = False
    """The output layer is the word embedding (no output_layer.weight)."""
    qk_layernorm: bool = False
    """A norm (the model's kind) over each head's q and k before RoPE (Qwen3)."""
    num_experts: int | None = None
    """Mixture of experts: routed experts per layer (each an MLP of ffn_hidden_size); None: dense."""
    moe_router_topk: int = 2
    """Experts per token (MoE)."""
    moe_norm_topk_prob: bool = True
    """MoE weights: softmax over the top-k logits (true) or the top-k of a softmax over all (false)."""

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: the KV cache holds this many per layer."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @classmethod
    def from_model_config(cls, cfg: Any) -> GptShape:
        """From a slurm_align.config.run.ModelConfig."""
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn,
                   cfg.vocab_size, cfg.padded_vocab_size, cfg.max_seq_len,
                   layernorm_epsilon=cfg.norm_epsilon, position_embedding=cfg.position_embedding,
                   rotary_base=cfg.rotary_base, rope_scaling=cfg.rope_scaling, normalization=cfg.normalization,
                   activation=cfg.activation, num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
                   add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
                   tie_embeddings=cfg.tie_embeddings, qk_layernorm=cfg.qk_layernorm,
                   num_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                   moe_norm_topk_prob=cfg.moe_norm_topk_prob)


@dataclass
class GenerationOutput:
    """Responses of one `generate` call, in prompt order.

    response_tokens: [n, max_len] int64, right-padded with pad_id past response_lengths.
    response_lengths: [n] int64; includes the EOS token when a sample ended on it.
    is_end: [n] bool; True when the sample emitted EOS, False when cut at max_new_tokens.
    logprobs: [n, max_len] float32 (0 past the length) or None: each sampled token's log-prob
    at the sampling temperature, before top-k/top-p (SamplingParams.return_logprobs).
    """

    response_tokens: torch.Tensor
    response_lengths: torch.Tensor
    is_end: torch.Tensor
    logprobs: torch.Tensor | None = None

    def responses(self) -> list[torch.Tensor]:
        """Ragged view: one 1-D token tensor per sample."""
        return [t[:n] for t, n in zip(self.response_tokens, self.response_lengths.tolist())]
