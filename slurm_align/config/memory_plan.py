"""The memory plan of a run: bytes per GPU of each component, from the run config alone (no torch,
no model built), checked against the profile's `gpu_memory_gib` before anything is submitted.

Per trained model and rank: weights (its dtype), gradients (fp32: the flat layout's `main_grad`
or fp32 `.grad`), fp32 main weights (bf16 only) and Adam's two fp32 moments, the last two
divided by DP under ZeRO-1 (models/optimizer.py); activations of one micro-batch; the critic's
reward model, when resident, its weights (the PPO and DPO references live in host memory and
are swapped into the policy's own tensors, HostSwap: no GPU memory); the actor's generation
engine its weights and the KV cache of one prompt batch. The actor peaks either while training
or while generating (the optimizer state and gradients are in host memory then with
switches.offload_optimizer), so its total is the larger of the two phases.

Parameters are counted per rank exactly as megatron's GPT local spec holds them (TP shards:
QKV, fc1, embedding and output rows; proj and fc2 columns; norms, biases of row-parallel layers
and learned positions replicated). Activations per transformer layer and micro-batch of s
tokens x b rows (elements), after Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (2022), Table 2, without their dropout terms (the models here have no
dropout): sb[4h + (q + k + v + context)/t + a s/t + (fc1 out + fc2 in)/t], where a s/t is the
softmax output; 'selective' recompute drops it, 'full' keeps only each layer's input (s b h)
plus the larger of the logits and one recompute chunk's full activations (the logits are freed
before the backward pass recomputes the layers). Under PP the first stage holds PP micro-batches
(1F1B), i.e. L/PP layers x PP. Logits: 2 s b V/t fp32 (logits and log-softmax).
MoE layers (megatron's TopKRouter + SequentialMLP, TP 1): the router replicated, num_experts /
expert_parallel experts per rank, each an MLP of ffn_hidden_size; under ZeRO-1 the experts'
main weights and Adam state are split over the expert-data-parallel group (data_parallel /
expert_parallel ranks), the rest over data_parallel (models/optimizer.py's two buckets). Their
activations count each token's top-k expert MLPs and its copies for the dispatch (an estimate:
not compared with a measured peak, unlike the dense terms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import ModelConfig, ParallelConfig, RunConfig, TrainingConfig

GIB = 1024 ** 3
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass
class ModelPlan:
    """Bytes one rank holds for one model."""

    name: str
    params: int                 # this rank's parameter count
    trained: int                # of which the optimizer trains (LoRA: the adapters)
    weights: int = 0
    grads: int = 0
    main_weights: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def training_total(self) -> int:
        return self.weights + self.grads + self.main_weights + self.optimizer + self.activations


@dataclass
class ComponentPlan:
    name: str
    models: list[ModelPlan] = field(default_factory=list)
    engine_weights: int = 0
    kv_cache: int = 0
    generation_peak: int = 0    # actor: weights + engine + KV (+ optimizer state when not offloaded)

    @property
    def total(self) -> int:
        return max(sum(m.training_total for m in self.models), self.generation_peak)


def _expert_params(m: ModelConfig, ep: int) -> int:
    """One MoE layer's experts on one rank (its num_experts / ep of them; 0 for a dense model)."""
    if m.num_experts is None:
        return 0
    h, f = m.hidden_size, m.ffn
    fc1_out = 2 * f if m.activation == "swiglu" else f
    one = fc1_out * h + h * f + ((fc1_out + h) if m.add_bias_linear else 0)
    return m.num_experts // ep * one


def _layer_params(m: ModelConfig, tp: int) -> int:
    """One transformer layer's parameters on one TP rank (megatron GPT, local spec), without an
    MoE layer's experts (_expert_params): its router instead of the dense MLP."""
    h, d, a, g, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups, m.ffn
    norm = 2 * h if m.normalization == "LayerNorm" else h
    qkv_out = (a + 2 * g) * d
    n = 2 * norm                                          # input and pre-MLP norms
    n += qkv_out * h // tp + (qkv_out // tp if (m.add_qkv_bias or m.add_bias_linear) else 0)
    if m.qk_layernorm:
        n += 2 * (2 * d if m.normalization == "LayerNorm" else d)
    n += h * a * d // tp + (h if m.add_bias_linear else 0)   # proj: row-parallel, bias replicated
    if m.num_experts is not None:   # the router: [experts, h] (+ bias), replicated
        return n + m.num_experts * h + (m.num_experts if m.add_bias_linear else 0)
    fc1_out = 2 * f if m.activation == "swiglu" else f
    n += fc1_out * h // tp + (fc1_out // tp if m.add_bias_linear else 0)
    n += h * f // tp + (h if m.add_bias_linear else 0)       # fc2
    return n


def _lora_layer_params(m: ModelConfig, tp: int) -> int:
    """One layer's LoRA adapters on one TP rank (models/lora.py shapes)."""
    assert m.lora is not None
    h, d, a, g, f, r = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups, m.ffn, m.lora.rank
    fc1_out = 2 * f if m.activation == "swiglu" else f
    shapes = {"qkv": r * h + (a + 2 * g) * d // tp * r, "proj": r * (a * d) // tp + h * r,
              "fc1": r * h + fc1_out // tp * r, "fc2": r * f // tp + h * r}
    return sum(shapes[t] for t in m.lora.targets)


def count_params(m: ModelConfig, par: ParallelConfig, *, value_head: bool = False, stage: int = 0) -> tuple[int, int]:
    """(parameters, trained parameters) on one rank of pipeline stage `stage` (MoE experts
    included: count_expert_params says how many of them are experts)."""
    tp, pp = par.tensor_parallel, par.pipeline_parallel
    h, V = m.hidden_size, m.padded_vocab_size
    layers = m.num_layers // pp
    n = layers * (_layer_params(m, tp) + _expert_params(m, par.expert_parallel))
    if stage == 0:
        n += V * h // tp + (m.max_seq_len * h if m.position_embedding == "learned" else 0)
    if stage == pp - 1:
        n += 2 * h if m.normalization == "LayerNorm" else h                 # final norm
        if value_head:
            n += h + 1
        elif not (m.tie_embeddings and pp == 1):   # tied under PP: the last stage keeps a copy
            n += V * h // tp
    if m.lora is not None and not value_head:
        return n, layers * _lora_layer_params(m, tp)
    return n, n


def count_expert_params(m: ModelConfig, par: ParallelConfig) -> int:
    """Expert parameters on one rank (any stage: every stage holds L / PP MoE layers)."""
    return m.num_layers // par.pipeline_parallel * _expert_params(m, par.expert_parallel)


def activation_elements(m: ModelConfig, tp: int, pp: int, tokens: int, rows: int, recompute: str,
                        recompute_layers: int = 1) -> int:
    """Activation elements one rank keeps for the backward pass of its stage (see module doc)."""
    s = tokens // max(rows, 1)
    sb = tokens
    h, d, a, g, f = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups, m.ffn
    fc1_out = 2 * f if m.activation == "swiglu" else f
    softmax = a * s // tp
    mlp = fc1_out + f
    if m.num_experts is not None:   # top-k experts' MLPs per token, its dispatched copies, router logits
        mlp = m.moe_router_topk * (fc1_out + f + 2 * h) + m.num_experts
    per_layer = sb * (4 * h + ((2 * a + 2 * g) * d + mlp) // tp + softmax)
    layers = m.num_layers // pp * (pp if pp > 1 else 1)   # 1F1B: the first stage holds PP micro-batches
    logits = 2 * sb * m.padded_vocab_size // tp
    if recompute == "full":
        # the layers' inputs; then either the logits (end of forward) or, later in the backward
        # pass, once the logits are freed, one recompute chunk's full activations
        return layers * sb * h + max(recompute_layers * per_layer, logits)
    if recompute == "selective":
        return layers * (per_layer - sb * softmax) + logits
    return layers * per_layer + logits


def plan_model(name: str, m: ModelConfig, par: ParallelConfig, t: TrainingConfig | None, *, tokens: int = 0,
               rows: int = 1, value_head: bool = False) -> ModelPlan:
    """One model on the busiest rank (stage 0 or the last, whichever holds more); `t` None: frozen."""
    counts = [count_params(m, par, value_head=value_head, stage=st) for st in {0, par.pipeline_parallel - 1}]
    params, trained = max(counts)
    dtype = DTYPE_BYTES[t.precision if t is not None else "fp32"]
    p = ModelPlan(name, params, trained if t is not None else 0, weights=params * dtype)
    if t is None:
        return p
    # ZeRO-1 buckets: the dense weights over DP, MoE experts over the expert-DP group (DP / EP)
    experts = count_expert_params(m, par) if m.lora is None else 0
    dp, edp = par.data_parallel, par.data_parallel // par.expert_parallel
    buckets = [(trained - experts, dp if t.distributed_optimizer else 1),
               (experts, edp if t.distributed_optimizer else 1)]
    p.grads = 4 * trained
    if t.precision != "fp32" or t.distributed_optimizer:
        p.main_weights = sum(-(-4 * n // shards) for n, shards in buckets)
    p.optimizer = sum(-(-8 * n // shards) for n, shards in buckets)
    p.activations = dtype * activation_elements(m, par.tensor_parallel, par.pipeline_parallel, tokens, rows,
                                                t.recompute, t.recompute_num_layers)
    return p


def plan_run(run: RunConfig) -> list[ComponentPlan]:
    """Every component's plan (bytes per GPU of its busiest rank)."""
    comps = []
    seq, t = run.model.max_seq_len, run.training
    if run.spec.rollout:
        mbs = run.ppo.train_micro_batch_size
        actor = ComponentPlan("actor")
        policy = plan_model("policy", run.model, run.actor, t, tokens=mbs * seq, rows=mbs)
        actor.models.append(policy)
        m = run.model
        engine_params = sum(count_params(m, run.actor, stage=st)[0] for st in range(run.actor.pipeline_parallel))
        actor.engine_weights = engine_params * DTYPE_BYTES[t.precision]
        sequences = run.generation.prompt_batch_size * run.rl.n_samples_per_prompt
        actor.kv_cache = (2 * m.num_layers * m.query_groups * m.head_dim * sequences * seq
                          // run.actor.tensor_parallel * DTYPE_BYTES[t.precision])
        held = 0 if run.switches.offload_optimizer else policy.grads + policy.main_weights + policy.optimizer
        actor.generation_peak = policy.weights + actor.engine_weights + actor.kv_cache + held
        comps.append(actor)
        if "critic" in run.components:
            cm = run.critic_model_config
            critic = ComponentPlan("critic")
            if run.critic_trains:
                critic.models.append(plan_model("value", cm, run.critic, t, tokens=mbs * cm.max_seq_len, rows=mbs,
                                                value_head=True))
            if run.switches.keep_critic_models_resident or not run.critic_trains:
                critic.models.append(plan_model("reward", cm, run.critic, None, value_head=True))
            comps.append(critic)
    else:
        per_item = 2 if run.algorithm in ("rm", "dpo") else 1   # pairs: chosen and rejected
        rows = run.trainer.micro_batch_size * per_item
        comp = ComponentPlan("actor")
        comp.models.append(plan_model(run.algorithm, run.model, run.actor, t, tokens=rows * seq, rows=rows,
                                      value_head=run.algorithm == "rm"))
        comps.append(comp)
    return comps


def render_plan(comps: list[ComponentPlan], profile: ClusterProfile) -> str:
    """The plan as a table (GiB per GPU), with the profile's device memory."""
    def gib(n: int) -> str:
        return f"{n / GIB:9.2f}"
    lines = [f"{'component':10} {'model':10} {'params':>14} {'weights':>9} {'grads':>9} {'main':>9} "
             f"{'optim':>9} {'activ':>9}   (GiB per GPU)"]
    for c in comps:
        for m in c.models:
            lines.append(f"{c.name:10} {m.name:10} {m.params:14,d} {gib(m.weights)} {gib(m.grads)} "
                         f"{gib(m.main_weights)} {gib(m.optimizer)} {gib(m.activations)}")
        if c.engine_weights or c.kv_cache:
            lines.append(f"{c.name:10} {'engine':10} {'':14} {gib(c.engine_weights)}  KV cache {gib(c.kv_cache)}"
                         f"  generation phase {gib(c.generation_peak)}")
        cap = profile.gpu_memory_gib
        verdict = "" if cap is None else (" fits" if c.total <= cap * GIB else " DOES NOT FIT")
        limit = "no gpu_memory_gib in the profile" if cap is None else f"of {cap:g} GiB"
        lines.append(f"{c.name:10} {'TOTAL':10} {gib(c.total)} GiB {limit}{verdict}")
    return "\n".join(lines)


def _fitting_changes(run: RunConfig, component: str, cap_bytes: float) -> list[str]:
    """Single overrides (and their combination) of the training section under which `component`
    would fit: what the refusal proposes."""
    t = run.training
    options: dict[str, dict[str, Any]] = {"training.distributed_optimizer=true": {"distributed_optimizer": True},
               "training.precision=bf16": {"precision": "bf16"},
               "training.recompute=full": {"recompute": "full"}}
    options = {k: v for k, v in options.items() if any(getattr(t, f) != x for f, x in v.items())}
    if len(options) > 1:
        options[" ".join(options)] = {f: x for v in options.values() for f, x in v.items()}
    fits = []
    for text, update in options.items():
        changed = run.model_copy(update={"training": t.model_copy(update=update)})
        total = next(c.total for c in plan_run(changed) if c.name == component)
        if total <= cap_bytes:
            fits.append(f"{text} ({total / GIB:.2f} GiB)")
    return fits


def check_memory(run: RunConfig, profile: ClusterProfile, *, source: str = "run config") -> list[ComponentPlan]:
    """Refuse (ConfigError) a run whose plan exceeds the profile's gpu_memory_gib on any component.
    Nothing is checked (an empty plan) without that field. Returns the plan."""
    cap = profile.gpu_memory_gib
    if cap is None:
        return []
    comps = plan_run(run)
    for c in comps:
        if c.total > cap * GIB:
            fits = _fitting_changes(run, c.name, cap * GIB)
            would = ("it would fit with " + "; or ".join(fits)) if fits else (
                f"no training setting alone makes it fit: raise {c.name}.tensor_parallel / pipeline_parallel "
                "or lower the micro-batch")
            raise ConfigError([f"field '{c.name}' (its layout and the training section): needs "
                               f"{c.total / GIB:.2f} GiB per GPU, more than profile {profile.name!r} "
                               f"gpu_memory_gib={cap:g}; {would} (or submit --skip-memory-check)\n"
                               + render_plan(comps, profile)], source)
    return comps
