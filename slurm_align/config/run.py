"""The run config: what to train, how it is parallelised, and the PPO/trainer hyper-parameters.

One YAML file per run (see examples/). Sizes of the allocation live in the cluster profile
(profile.py); `check_against_profile` ties the two together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from slurm_align.config.base import StrictModel

Algorithm = Literal["ppo", "sft", "rm", "dpo"]
COMPONENTS = ("actor", "critic")


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


class ModelConfig(StrictModel):
    """A GPT (megatron-core GPTModel) shape; the same shape serves policy, value and reward."""

    num_layers: int = Field(2, ge=1)
    """Transformer layers."""
    hidden_size: int = Field(64, ge=8)
    """Model width."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads; must divide hidden_size."""
    ffn_hidden_size: int | None = Field(None, ge=8)
    """MLP width; default 4 x hidden_size."""
    vocab_size: int = Field(260, ge=2)
    """Vocabulary size (padded up per TP as megatron does)."""
    max_seq_len: int = Field(128, ge=2)
    """Longest prompt+response the model accepts (position embeddings)."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer to turn text data into ids."""
    init_checkpoint: Path | None = None
    """Checkpoint to start from (an SFT result for the policy, an RM result for the critic)."""

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            )
        return self

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel


class DataConfig(StrictModel):
    train_path: Path | None = None
    """JSONL training data: prompts {"prompt"} (PPO), {"input","output"} (SFT),
    {"prompt","chosen","rejected"} (RM, DPO)."""
    val_path: Path | None = None
    """JSONL validation data, same format as train_path."""


class GenerationConfig(StrictModel):
    engine: Literal["torch", "naive", "trtllm"] = "torch"
    """Generation engine: KV-cache torch engine, the naive recompute baseline, or TensorRT-LLM (GPU)."""
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


class PPOConfig(StrictModel):
    """PPO as NeMo-Aligner defines it."""

    num_steps: int = Field(4, ge=1)
    """PPO steps (rollout + update) to run."""
    num_rollout_samples: int = Field(16, ge=1)
    """Prompts per step (global)."""
    train_micro_batch_size: int = Field(4, ge=1)
    """Samples per training micro-batch per DP rank."""
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
    save_interval: int = Field(0, ge=0)
    """Checkpoint every K steps (0: only at the end)."""


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
    dpo_beta: float = Field(0.1, gt=0)
    """DPO temperature beta."""
    save_interval: int = Field(0, ge=0)
    """Checkpoint every K steps (0: only at the end)."""
    eval_interval: int = Field(0, ge=0)
    """Evaluate on val_path every K steps (0: only at the end)."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples (pairs for rm/dpo) per micro-batch on each DP rank; the step's per-rank share
    global_batch_size / data_parallel is split into micro-batches of this size."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0: no clipping)."""


class CriticServerConfig(StrictModel):
    port: int = Field(18000, ge=1024, le=65535)
    """HTTP port of the critic's PyTriton server (gRPC and metrics use port+1, port+2)."""
    bind_host: str | None = None
    """Address to bind; default: this host's own address from the job's node list (never 0.0.0.0)."""
    connect_timeout_s: float = Field(120.0, gt=0)
    """How long the actor keeps retrying (with backoff) while the critic starts."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Upper bound on one critic request; a hung critic is an error after this."""


class SweepConfig(StrictModel):
    """How `slurm-align sweep` scales this run over node counts."""

    actor_to_critic_nodes: str = Field("2:1", pattern=r"^[1-9][0-9]*:[1-9][0-9]*$")
    """Ratio 'A:C' of actor to critic nodes. `--nodes` gives the actor's node counts; the
    critic gets ceil(actor_nodes * C / A) nodes, at least 1 (ppo only)."""


class RunConfig(StrictModel):
    """One run: algorithm, models, parallelism per component, hyper-parameters, switches."""

    algorithm: Algorithm = "ppo"
    """ppo (actor+critic hetjob), or sft / rm / dpo (one component)."""
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
    data: DataConfig = DataConfig()
    """Datasets."""
    generation: GenerationConfig = GenerationConfig()
    """Rollout generation."""
    switches: Switches = Switches()
    """Optimisation switches (ablation)."""
    ppo: PPOConfig = PPOConfig()
    """PPO hyper-parameters."""
    trainer: TrainerConfig = TrainerConfig()
    """SFT / RM / DPO hyper-parameters."""
    critic_server: CriticServerConfig = CriticServerConfig()
    """Critic server address and timeouts."""
    sweep: SweepConfig = SweepConfig()
    """Node scaling rule for `slurm-align sweep`."""

    @model_validator(mode="after")
    def _layouts_fit_models(self):
        pairs = [("actor", self.actor, self.model)]
        if self.algorithm == "ppo":
            pairs.append(("critic", self.critic, self.critic_model or self.model))
        for name, par, m in pairs:
            if m.num_attention_heads % par.tensor_parallel:
                raise ValueError(
                    f"{name}.tensor_parallel={par.tensor_parallel} must divide "
                    f"num_attention_heads={m.num_attention_heads}"
                )
            if m.num_layers % par.pipeline_parallel:
                raise ValueError(
                    f"{name}.pipeline_parallel={par.pipeline_parallel} must divide num_layers={m.num_layers}"
                )
        return self

    @property
    def components(self) -> tuple[str, ...]:
        """Job components this run needs: actor and critic for PPO, one for the rest."""
        return COMPONENTS if self.algorithm == "ppo" else ("actor",)

    def parallel(self, component: str) -> ParallelConfig:
        return {"actor": self.actor, "critic": self.critic}[component]

    @property
    def critic_model_config(self) -> ModelConfig:
        return self.critic_model or self.model
