"""Step time predicted before submitting: a cost per phase from the architecture and the layout,
combined as `PPOActor.step` (algorithms/ppo.py) orders and overlaps the phases.

Each phase's ideal time is its work at the hardware's peak (planning/hardware.py), divided by an
efficiency (a default, or fitted from a finished run: planning/calibration.py):

- generate: the engine batches (generation.prompt_batch_size prompts x rl.n_samples_per_prompt)
  handed out by the prompt server. A batch costs its prefill, FLOPs of the prompts at the FLOP
  peak, and its decode: per decode step max(FLOPs / peak FLOPs, bytes / memory bandwidth), the
  bytes being the weights once plus the KV cache of every sequence still decoding; the batch
  decodes until its longest response ends. Work-stealing (switches.dynamic_prompts) is simulated
  as list scheduling (the next batch goes to the replica free first), static sharding as
  contiguous shards. Replicas: DP x PP with refold, else DP (the stages of a replica work in
  turn), each of TP ranks.
- logprobs, init_logprobs, train: forward FLOPs (train: 3 x forward per epoch) of a DP rank's
  share of the step's sequences over its TP x PP ranks, times the pipeline bubble
  (1 + (PP - 1) / micro-batches); train adds the gradient ring all-reduce per optimizer step,
  2 (DP - 1) / DP x the rank's gradient bytes over the DP group's link (intra- or inter-node).
- critic_infer / critic_train: the same on the critic's layout and hardware (a PPO critic scores
  with the value and the reward model, two forwards; a reward-only critic with one).
- refit: the rank's weight copy into the engine over memory bandwidth, plus with refold and PP > 1
  the other stages' weights over the actor's link. weight_sync (disaggregated): the weights over
  the inter-node link. rebalance: the step's per-token columns, a DP rank's share rebuilt in
  memory and the rest over the actor's link.
- store and anything else without a work model: a constant (the calibration's measurement).

Collectives cost a latency plus a ring's bytes over the link (collective_s; the profile's
intra- or inter-node figures, by whether one node holds the group) and join their phase outside
its efficiency (`<phase>.link`): TP's all-reduces, two per layer of the activations, per
micro-batch and direction in the passes and at the prefill and every decode step in generation
(latency-bound at small batches: what makes a wide TP slow for small models); train's gradient
all-reduce and the optimizer step's two small sums over DP (TRAIN_DP_COLLECTIVES).

The combination (colocated): refit, generate, rebalance, logprobs, init_logprobs, critic_wait,
store, train, critic_wait, other, in turn on the actor. The critic scores each generation micro-batch as
it comes, so after generation it has left max(one micro-batch, its total minus what it did while
generation ran); the actor's first critic_wait is what is left of that after rebalance and its
log-prob passes (a faster critic adds no wait). The critic's update is sent before the actor
trains; the second critic_wait is the critic's update time beyond the actor's. Disaggregated, the
generator generates the next step while the actor trains (max_off_policy_steps >= 1): the step
is the slower of the two; on-policy (0) their sum.

On a shared host (the local test cluster: its 'nodes' are processes on this one machine) the
actor's phases run at share = host cores / the job's cores (when below 1: compute divided by the
oversubscription), as every other component may compute meanwhile; the critic's passes at host
cores / the critic's own cores, as the actor's ranks mostly wait for them, asleep. The constant
phases are the actor's CPU work too, so they move with its share from the calibration's to the
predicted.

Known to be wrong: PP's activation sends, the optimizer step, the collectives' overlap with compute
(counted in full, after it), Python overheads per call (on small models these dominate; the
calibration folds them into the efficiencies, so a fitted efficiency transfers best to layouts of
the same model), memory-bound training, and on a shared host the other jobs' load (not known before
submitting) and the waits of ranks that the scheduler runs at different times (a collective waits
for its last rank; more ranks, longer).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import ModelConfig, ParallelConfig, RunConfig
from slurm_align.planning.hardware import Hardware, profile_hardware

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = 4   # fp32 gradients (the trainers' and megatron's main_grad)

DEFAULT_EFFICIENCY: dict[str, float] = {
    "generate": 0.5, "logprobs": 0.5, "init_logprobs": 0.5, "train": 0.4, "critic_infer": 0.5,
    "critic_train": 0.4, "refit": 0.7, "rebalance": 0.7, "weight_sync": 0.7,
}
"""Fraction of peak each phase reaches without a calibration (typical large-model figures)."""
MODELLED = tuple(DEFAULT_EFFICIENCY)
CONSTANT_PHASES = ("store", "save", "other")
"""Phases without a work model: their time is a calibrated constant (default 0). `save` is the
checkpoint save on the step's critical path (its median over the steps, so a run that saves every
k steps spreads it; with checkpointing.async_save only the host copy); `other` is the actor's
step time outside every span (metrics, the critic's update request, ...)."""


@dataclass(frozen=True)
class ModelShape:
    """What the cost functions need of a transformer (counts of parameters, not of memory)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    mlp_matrices: int
    """2 for GELU MLPs, 3 for SwiGLU (gate, up, down)."""
    experts: int
    """Routed experts per layer (1: dense)."""
    topk: int
    """Experts a token passes through (1: dense)."""
    output: int
    """Output layer width: the vocabulary, or 1 for a value head."""
    tied: bool
    position_rows: int
    """Learned position embedding rows (0 with RoPE)."""

    @classmethod
    def of(cls, m: ModelConfig, *, value_head: bool = False) -> ModelShape:
        moe = m.num_experts is not None
        return cls(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads, groups=m.query_groups,
                   head_dim=m.head_dim, ffn=m.ffn, vocab=m.padded_vocab_size,
                   mlp_matrices=3 if m.activation == "swiglu" else 2, experts=m.num_experts or 1,
                   topk=m.moe_router_topk if moe else 1, output=1 if value_head else m.padded_vocab_size,
                   tied=m.tie_embeddings and not value_head,
                   position_rows=m.max_seq_len if m.position_embedding == "learned" else 0)

    def _attention_params(self) -> int:
        return self.hidden * (self.heads + 2 * self.groups) * self.head_dim + self.heads * self.head_dim * self.hidden

    def _router(self) -> int:
        return self.hidden * self.experts if self.experts > 1 else 0

    @functools.cached_property   # the cost functions read it per token and step
    def matmul_params(self) -> int:
        """Weights one token multiplies through (active experts only, output layer included)."""
        per_layer = self._attention_params() + self.mlp_matrices * self.hidden * self.ffn * self.topk + self._router()
        return self.layers * per_layer + self.hidden * self.output

    @functools.cached_property   # the cost functions read it per token and step
    def params(self) -> int:
        """Every weight (all experts, embeddings; norms and biases left out)."""
        mlp = self.mlp_matrices * self.hidden * self.ffn * self.experts
        per_layer = self._attention_params() + mlp + self._router()
        output = 0 if self.tied else self.hidden * self.output
        return self.layers * per_layer + self.vocab * self.hidden + output + self.position_rows * self.hidden

    @functools.cached_property   # the cost functions read it per token and step
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    def forward_flops(self, length: int) -> float:
        """One causal forward over a sequence: 2 x matmul params per token, plus QK^T and AV,
        4 x layers x heads x head_dim per (query, key) pair, L^2 / 2 pairs."""
        return 2.0 * self.matmul_params * length + 2.0 * self.layers * self.attention_width * length**2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.groups * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class Workload:
    """The step's sequences: per sample its prompt and response length (sample i of the step gets
    prompt_lengths[i % len] and response_lengths[i % len]: a measured distribution replayed)."""

    samples: int
    prompt_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]

    @classmethod
    def default(cls, run: RunConfig) -> Workload:
        """Before any run: prompts half of what the context leaves, every response at its limit."""
        new = run.generation.max_new_tokens
        return cls(run.rollouts_per_step, (max(1, (run.model.max_seq_len - new) // 2),), (new,))

    def with_samples(self, samples: int) -> Workload:
        return Workload(samples, self.prompt_lengths, self.response_lengths)

    def prompt(self, i: int) -> int:
        return self.prompt_lengths[i % len(self.prompt_lengths)]

    def response(self, i: int) -> int:
        return self.response_lengths[i % len(self.response_lengths)]

    def lengths(self) -> list[int]:
        return [self.prompt(i) + self.response(i) for i in range(self.samples)]

    @property
    def tokens(self) -> int:
        return sum(self.lengths())


@dataclass
class Costs:
    """Efficiencies per modelled phase and constants (seconds) per unmodelled one."""

    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    constant_s: dict[str, float] = field(default_factory=dict)
    constant_share: float = 1.0
    """The share of its cores the actor had (steptime.share) where the constants were measured.
    They are the actor's CPU work outside the modelled phases (Python per step, the rollout
    store, saves), so at another share they take constant_s x constant_share / share: on a
    shared host a job of more ranks does the same per-step work on fewer cores each."""
    rebalance_before_wait: float = 0.5
    """Share of rebalance before the log-prob passes (the route and the tokens' alltoall); the rest
    (values and rewards along the route, advantages, the gather) comes after the critic's wait."""

    def eff(self, phase: str) -> float:
        return self.efficiency.get(phase, DEFAULT_EFFICIENCY[phase])


@dataclass
class StepPrediction:
    phases: dict[str, float]
    """Predicted seconds per phase as the breakdown reports them (a rank's summed spans; the two
    critic waits summed into critic_wait)."""
    step_s: float
    bounding: str
    """The phase that contributes most to the step's critical path."""
    critical: dict[str, float]
    """Each phase's contribution to the critical path (critic waits attributed to the critic)."""
    layout: str


# -- the cost of each phase (ideal: at peak, efficiency 1) -----------------------------------
def share(hw: Hardware, busy_cores: int) -> float:
    """Fraction of its peak a rank gets: 1, or on a shared host (the local test cluster, whose
    'nodes' are processes on this one machine) the host's cores over the cores the job's ranks
    ask for, when they ask for more than it has (compute divided by the oversubscription)."""
    if hw.host_cores is None:
        return 1.0
    return min(1.0, hw.host_cores / busy_cores)


def component_cores(profile: ClusterProfile, component: str) -> int:
    """The cores a component's ranks ask for (its profile's ranks x cpus_per_task)."""
    res = profile.resources(component)
    return res.ranks * res.cpus_per_task


def job_cores(run: RunConfig, profile: ClusterProfile) -> int:
    """The cores every rank of the job asks for (component_cores over the run's components).
    On a shared host the actor's phases run while every other component may compute too: the
    critic scores while the actor generates, the generator generates the next step while the
    actor trains."""
    return sum(component_cores(profile, c) for c in run.components)


def actor_share(run: RunConfig, profile: ClusterProfile) -> float:
    """The share of its peak an actor rank gets (share over the job's cores)."""
    return share(profile_hardware(profile, "actor"), job_cores(run, profile))


def critic_share(profile: ClusterProfile) -> float:
    """The share of its peak a critic rank gets (share over the critic's own cores): while its
    passes run, the actor's ranks mostly wait for them, asleep (a waiting rank sleeps:
    parallel/quiet.py). Measured (benchmarks/bench_plan.py, three runs, 2 and 4 actor nodes): the
    critic's scoring passes -31%..+67% off, its updates +38%..+99%, against +58%..+227% and
    +107%..+399% with the job's cores counted."""
    return share(profile_hardware(profile, "critic"), component_cores(profile, "critic"))


def decode_step_s(shape: ModelShape, contexts: list[int], hw: Hardware, dtype: str, tp: int,
                  rate: float = 1.0) -> float:
    """One decode step of a batch whose sequences hold `contexts` tokens: FLOPs or bytes, the slower."""
    return _decode_step_s(shape, len(contexts), sum(contexts), hw.flops(dtype), hw.memory_bandwidth, dtype, tp, rate)


def _decode_step_s(shape: ModelShape, live: int, context_tokens: int, peak_flops: float, bandwidth: float,
                   dtype: str, tp: int, rate: float) -> float:
    """decode_step_s from the batch's live sequences and their summed context. Its FLOPs and bytes
    are integers (exact as floats below 2**53), so this equals summing them per sequence."""
    flops = 2.0 * shape.matmul_params * live + 4.0 * shape.layers * shape.attention_width * context_tokens
    nbytes = shape.params * DTYPE_BYTES[dtype] + shape.kv_bytes_per_token(DTYPE_BYTES[dtype]) * context_tokens
    return max(flops / (tp * peak_flops * rate), nbytes / (tp * bandwidth * rate))


def batch_generation_s(shape: ModelShape, prompts: list[int], responses: list[int], hw: Hardware, dtype: str,
                       tp: int, rate: float = 1.0) -> float:
    """Prefill of every prompt, then decode steps until the longest response ended (a sequence's
    KV cache is read while it decodes)."""
    return _batch_generation_s(shape, tuple(prompts), tuple(responses), hw.flops(dtype), hw.memory_bandwidth,
                               dtype, tp, rate)


@functools.lru_cache(maxsize=4096)
def _batch_generation_s(shape: ModelShape, prompts: tuple[int, ...], responses: tuple[int, ...], peak_flops: float,
                        bandwidth: float, dtype: str, tp: int, rate: float) -> float:
    """batch_generation_s on hashable arguments, cached: `plan --advise` costs the same engine
    batches on many layouts. The live sequences and their summed context per step: `decoding`."""
    t = sum(shape.forward_flops(p) for p in prompts) / (tp * peak_flops * rate)
    for step, live, prompt_tokens in decoding(prompts, responses):
        t += _decode_step_s(shape, live, prompt_tokens + step * live, peak_flops, bandwidth, dtype, tp, rate)
    return t


def decoding(prompts: tuple[int, ...], responses: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
    """Per decode step of a batch: the step, the sequences still decoding and their prompts'
    tokens (a sequence leaves after its last token), kept step by step instead of rebuilt."""
    ending = sorted(zip(responses, prompts))   # by the step after which a sequence stops decoding
    live, prompt_tokens, gone = len(ending), sum(prompts), 0
    for step in range(max(responses, default=0)):
        while gone < len(ending) and ending[gone][0] <= step:
            live, prompt_tokens, gone = live - 1, prompt_tokens - ending[gone][1], gone + 1
        yield step, live, prompt_tokens


def engine_batches(run: RunConfig, work: Workload) -> list[list[int]]:
    """Sample indices of each engine batch, in the prompt server's order."""
    per = run.generation.prompt_batch_size * run.rl.n_samples_per_prompt
    return [list(range(i, min(i + per, work.samples))) for i in range(0, work.samples, per)]


def schedule(durations: list[float], replicas: int, dynamic: bool) -> tuple[float, list[float]]:
    """Makespan of batches on replicas, and each batch's end time. Dynamic: the next batch goes
    to the replica free first (work stealing); static: contiguous shards, one per replica."""
    ends = [0.0] * len(durations)
    if dynamic:
        free = [(0.0, r) for r in range(replicas)]
        for i, d in enumerate(durations):
            t, r = heapq.heappop(free)
            ends[i] = t + d
            heapq.heappush(free, (ends[i], r))
    else:
        per = math.ceil(len(durations) / replicas) if durations else 0
        for r in range(replicas):
            t = 0.0
            for i in range(r * per, min((r + 1) * per, len(durations))):
                t += durations[i]
                ends[i] = t
    return max(ends, default=0.0), ends


def _engine(run: RunConfig) -> tuple[str, int, int]:
    """The engine's component, its replicas and their TP ranks."""
    comp = run.engine_component
    par = run.parallel(comp)
    if comp == "generator":
        return comp, par.data_parallel, par.tensor_parallel
    return comp, par.data_parallel * (par.pipeline_parallel if run.switches.refold else 1), par.tensor_parallel


def generation_s(run: RunConfig, profile: ClusterProfile, work: Workload, dtype: str) -> tuple[float, int]:
    """Ideal generation time of the step and the number of engine batches."""
    comp, replicas, tp = _engine(run)
    hw = profile_hardware(profile, comp)
    rate = share(hw, job_cores(run, profile))
    shape = ModelShape.of(run.model)
    batches = engine_batches(run, work)
    durations = [batch_generation_s(shape, [work.prompt(i) for i in b], [work.response(i) for i in b],
                                    hw, dtype, tp, rate) for b in batches]
    makespan, _ = schedule(durations, replicas, run.switches.dynamic_prompts)
    return makespan, len(batches)


def generation_link_s(run: RunConfig, profile: ClusterProfile, work: Workload, dtype: str) -> float:
    """The step's tensor-parallel all-reduces in the engine (batch_link_s per engine batch),
    scheduled over the replicas as the batches are."""
    comp, replicas, tp = _engine(run)
    if tp == 1:
        return 0.0
    shape = ModelShape.of(run.model)
    bw, lat = link(profile, comp, tp)
    links = [batch_link_s(shape, tuple(work.prompt(i) for i in b), tuple(work.response(i) for i in b), tp,
                          DTYPE_BYTES[dtype], bw, lat) for b in engine_batches(run, work)]
    return schedule(links, replicas, run.switches.dynamic_prompts)[0]


@functools.lru_cache(maxsize=4096)
def batch_link_s(shape: ModelShape, prompts: tuple[int, ...], responses: tuple[int, ...], tp: int, dtype_bytes: int,
                 bandwidth: float, latency: float) -> float:
    """An engine batch's tensor-parallel all-reduces (Megatron's row-parallel outputs): two per
    layer (after attention, after the MLP) of the prefill's activations, then two per layer at
    each decode step of the sequences still decoding: latency-bound at small batches."""
    if tp == 1:
        return 0.0
    per_token = shape.hidden * dtype_bytes
    t = 2 * shape.layers * collective_s(sum(prompts) * per_token, tp, bandwidth, latency)
    for _, live, _ in decoding(prompts, responses):
        t += 2 * shape.layers * collective_s(live * per_token, tp, bandwidth, latency)
    return t


def link(profile: ClusterProfile, comp: str, group_size: int) -> tuple[float, float]:
    """The bandwidth and the latency of one collective of a group of ranks of `comp`: NVLink /
    shared memory when one node holds the group, else the NIC."""
    res, hw = profile.resources(comp), profile_hardware(profile, comp)
    if group_size <= res.tasks_per_node:
        return hw.intra_node_bandwidth, hw.intra_node_latency
    return hw.inter_node_bandwidth, hw.inter_node_latency


def link_bandwidth(profile: ClusterProfile, comp: str, group_size: int) -> float:
    """The bandwidth of `link`'s choice (the phases that move bytes without a collective's latency)."""
    return link(profile, comp, group_size)[0]


def collective_s(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One all-reduce of `nbytes` over `ranks`: its latency, and a ring's 2 (ranks - 1) / ranks of
    the bytes over the link (0 on one rank)."""
    if ranks <= 1:
        return 0.0
    return latency + 2.0 * (ranks - 1) / ranks * nbytes / bandwidth


def pass_flops(shape: ModelShape, lengths: list[int], passes: float = 1.0) -> float:
    """`passes` forwards over sequences of `lengths` (a backward counts as two forwards)."""
    return passes * sum(shape.forward_flops(n) for n in lengths)


def forward_pass_s(shape: ModelShape, par: ParallelConfig, lengths: list[int], hw: Hardware, dtype: str,
                   micro_batch: int, rate: float, passes: float = 1.0) -> float:
    """`passes` forwards of one DP rank's share of `lengths` on its TP x PP ranks, with the bubble."""
    dp, mp = par.data_parallel, par.tensor_parallel * par.pipeline_parallel
    flops = pass_flops(shape, lengths, passes) / dp
    micro_batches = max(1, math.ceil(len(lengths) / dp / micro_batch))
    bubble = 1.0 + (par.pipeline_parallel - 1) / micro_batches
    return flops / mp * bubble / (hw.flops(dtype) * rate)


TRAIN_DP_COLLECTIVES = 3
"""Data-parallel collectives of one optimizer step (models/worker.py): the loss normaliser's and
the metrics' sums (a few numbers each) and the gradients' all-reduce."""


def grad_reduce_s(shape: ModelShape, par: ParallelConfig, bandwidth: float, reductions: int,
                  latency: float = 0.0) -> float:
    """Ring all-reduce of a rank's gradients over DP and the step's two small sums, `reductions`
    times (one per optimizer step)."""
    dp = par.data_parallel
    if dp == 1:
        return 0.0
    grad_bytes = shape.params / (par.tensor_parallel * par.pipeline_parallel) * GRAD_BYTES
    return reductions * (collective_s(grad_bytes, dp, bandwidth, latency) + (TRAIN_DP_COLLECTIVES - 1) * latency)


def tp_pass_link_s(shape: ModelShape, par: ParallelConfig, lengths: list[int], micro_batch: int, dtype: str,
                   bandwidth: float, latency: float, directions: float = 1.0) -> float:
    """Tensor parallelism's all-reduces of one DP rank's passes (forward_pass_s's work): two per
    layer of a stage (after attention, after the MLP) per micro-batch and direction (1: forward;
    a training epoch's backward adds one), of the micro-batch's activations, times the bubble."""
    tp, dp, pp = par.tensor_parallel, par.data_parallel, par.pipeline_parallel
    if tp == 1:
        return 0.0
    micro_batches = max(1, math.ceil(len(lengths) / dp / micro_batch))
    mb_bytes = sum(lengths) / dp / micro_batches * shape.hidden * DTYPE_BYTES[dtype]
    bubble = 1.0 + (pp - 1) / micro_batches
    return directions * 2 * shape.layers / pp * micro_batches * collective_s(mb_bytes, tp, bandwidth, latency) * bubble


def optimizer_steps(run: RunConfig) -> int:
    gbs = run.ppo.global_batch_size or run.rollouts_per_step
    return run.ppo.epochs * (run.rollouts_per_step // gbs)


def ideal_phases(run: RunConfig, profile: ClusterProfile, work: Workload, dtype: str = "fp32") -> dict[str, float]:
    """Each modelled phase's time at efficiency 1 (seconds); a phase's collectives (TP's
    all-reduces, train's gradient all-reduce) are returned apart as `<phase>.link`: they run at
    the link's speed and latency, not at a compute efficiency."""
    out: dict[str, float] = {}
    lengths = work.lengths()
    a_par = run.actor
    a_hw = profile_hardware(profile, "actor")
    a_rate = share(a_hw, job_cores(run, profile))
    shape = ModelShape.of(run.model)
    wbytes = DTYPE_BYTES[dtype]
    mb = run.ppo.train_micro_batch_size
    out["generate.link"] = generation_link_s(run, profile, work, dtype)
    if run.rollout.mode == "colocated":
        out["generate"], _ = generation_s(run, profile, work, dtype)
        mp = a_par.tensor_parallel * a_par.pipeline_parallel
        local = shape.params / mp * wbytes / (a_hw.memory_bandwidth * a_rate)
        remote = 0.0
        if run.switches.refold and a_par.pipeline_parallel > 1:
            pp = a_par.pipeline_parallel
            remote = (shape.params * (pp - 1) / pp / a_par.tensor_parallel * wbytes
                      / link_bandwidth(profile, "actor", a_par.world_size))
        out["refit"] = local + remote
    else:
        out["generate"], _ = generation_s(run, profile, work, dtype)   # on the generator
        out["weight_sync"] = shape.params * wbytes / a_hw.inter_node_bandwidth
    # the step's per-token columns (8 of 4 bytes): a DP rank's share rebuilt in memory, the rest
    # moved over the link (the alltoall)
    columns = work.tokens * 4 * 8
    out["rebalance"] = (columns / a_par.data_parallel / (a_hw.memory_bandwidth * a_rate)
                        + columns * (a_par.data_parallel - 1) / a_par.data_parallel
                        / link_bandwidth(profile, "actor", a_par.world_size))
    out["logprobs"] = forward_pass_s(shape, a_par, lengths, a_hw, dtype, mb, a_rate)
    tp_link = link(profile, "actor", a_par.tensor_parallel)
    out["logprobs.link"] = tp_pass_link_s(shape, a_par, lengths, mb, dtype, *tp_link)
    out["init_logprobs"] = out["logprobs"] if run.uses_reference else 0.0
    out["init_logprobs.link"] = out["logprobs.link"] if run.uses_reference else 0.0
    out["train"] = forward_pass_s(shape, a_par, lengths, a_hw, dtype, mb, a_rate, passes=3.0 * run.ppo.epochs)
    dp_group = a_par.data_parallel * a_par.tensor_parallel * a_par.pipeline_parallel
    dp_bw, dp_lat = link(profile, "actor", dp_group)
    out["train.link"] = (grad_reduce_s(shape, a_par, dp_bw, optimizer_steps(run), dp_lat)
                         + tp_pass_link_s(shape, a_par, lengths, mb, dtype, *tp_link, directions=2.0 * run.ppo.epochs))
    if "critic" in run.components:
        c_par = run.critic
        c_hw = profile_hardware(profile, "critic")
        c_rate = critic_share(profile)
        c_shape = ModelShape.of(run.critic_model_config, value_head=True)
        models = (1 if run.critic_trains else 0) + (1 if run.reward.use_model else 0)
        out["critic_infer"] = forward_pass_s(c_shape, c_par, lengths, c_hw, dtype, mb, c_rate, passes=float(models))
        c_link = link(profile, "critic", c_par.tensor_parallel)
        out["critic_infer.link"] = tp_pass_link_s(c_shape, c_par, lengths, mb, dtype, *c_link, directions=models)
        if run.critic_trains:
            out["critic_train"] = forward_pass_s(c_shape, c_par, lengths, c_hw, dtype, mb, c_rate,
                                                 passes=3.0 * run.ppo.epochs)
            c_dp_bw, c_dp_lat = link(profile, "critic", c_par.world_size)
            out["critic_train.link"] = (
                grad_reduce_s(c_shape, c_par, c_dp_bw, run.ppo.epochs, c_dp_lat)
                + tp_pass_link_s(c_shape, c_par, lengths, mb, dtype, *c_link, directions=2.0 * run.ppo.epochs))
    return out


def step_model_flops(run: RunConfig, work: Workload) -> dict[str, float]:
    """The model FLOPs of one step per phase (MFU's numerator: the work the models' architecture
    needs, not what the kernels did): generation as one forward over each prompt + response
    (prefill and the decode steps add up to it), a forward per log-prob pass, 3 forwards per
    training epoch, and the critic's value and reward models likewise."""
    lengths = work.lengths()
    shape = ModelShape.of(run.model)
    out = {"generate": pass_flops(shape, lengths), "logprobs": pass_flops(shape, lengths),
           "init_logprobs": pass_flops(shape, lengths) if run.uses_reference else 0.0,
           "train": pass_flops(shape, lengths, 3.0 * run.ppo.epochs)}
    if "critic" in run.components:
        c_shape = ModelShape.of(run.critic_model_config, value_head=True)
        models = (1 if run.critic_trains else 0) + (1 if run.reward.use_model else 0)
        out["critic_infer"] = pass_flops(c_shape, lengths, float(models))
        out["critic_train"] = pass_flops(c_shape, lengths, 3.0 * run.ppo.epochs) if run.critic_trains else 0.0
    return out


def phase_times(ideal: dict[str, float], costs: Costs, share: float = 1.0) -> dict[str, float]:
    """Ideal times at the phases' efficiencies, each with its collectives (`<phase>.link`) added;
    the constant phases at the actor's `share` of its cores (Costs.constant_share)."""
    out = {p: t / costs.eff(p) + ideal.get(f"{p}.link", 0.0) for p, t in ideal.items() if p in MODELLED}
    for p in CONSTANT_PHASES:
        out[p] = costs.constant_s.get(p, 0.0) * costs.constant_share / share
    return out


def combine(t: dict[str, float], *, engine_batches: int, disaggregated: bool = False,
            max_off_policy_steps: int = 1,
            rebalance_before_wait: float = 0.5) -> tuple[float, dict[str, float], dict[str, float]]:
    """The step from phase times, as PPOActor.step runs them. Returns (step seconds, the phases
    as the breakdown reports them, each phase's contribution to the critical path)."""
    g = lambda p: t.get(p, 0.0)  # noqa: E731  (a phase the run has not)
    n = max(1, engine_batches)
    # The critic scored micro-batches while generation ran; what is left after it:
    left = max(g("critic_infer") / n, g("critic_infer") - g("generate") * (1 - 1 / n))
    before_wait = g("rebalance") * rebalance_before_wait + g("logprobs") + g("init_logprobs")
    wait1 = max(0.0, left - before_wait)
    wait2 = max(0.0, g("critic_train") - g("train"))
    crit = {"refit": g("refit"), "generate": g("generate"), "rebalance": g("rebalance"),
            "logprobs": g("logprobs"), "init_logprobs": g("init_logprobs"), "critic_infer": wait1,
            "store": g("store"), "save": g("save"), "train": g("train") if wait2 == 0 else 0.0,
            "critic_train": g("train") + wait2 if wait2 > 0 else 0.0, "weight_sync": g("weight_sync"),
            "other": g("other")}
    if disaggregated:
        gen = g("generate") + g("weight_sync")   # the generator applies each version before generating
        trainer = sum(v for k, v in crit.items() if k not in ("generate", "refit"))
        if max_off_policy_steps >= 1 and gen > trainer:
            crit = {"generate": gen, **{k: 0.0 for k in crit if k != "generate"}}
            step = gen
        elif max_off_policy_steps >= 1:
            crit["generate"] = 0.0
            step = trainer
        else:
            step = gen + trainer
    else:
        step = sum(crit.values())
    phases = {k: v for k, v in t.items() if k in MODELLED or k in CONSTANT_PHASES}
    if "critic_infer" in t:
        phases["critic_wait"] = wait1 + wait2
    return step, phases, crit


def describe(run: RunConfig, profile: ClusterProfile) -> str:
    parts = []
    for comp in run.components:
        par, res = run.parallel(comp), profile.resources(comp)
        parts.append(f"{comp} {res.nodes}n tp{par.tensor_parallel} pp{par.pipeline_parallel} dp{par.data_parallel}")
    return ", ".join(parts)


def predict(run: RunConfig, profile: ClusterProfile, *, costs: Costs | None = None, work: Workload | None = None,
            dtype: str = "fp32") -> StepPrediction:
    """Predicted step time of `run` on `profile` (its components' nodes and ranks as given)."""
    if not run.spec.rollout:
        raise ConfigError.at("algorithm", run.algorithm, "the step-time plan covers the rollout algorithms "
                             "(ppo, grpo, rloo, reinforce_pp, rejection_sampling), whose step it models")
    costs = costs or Costs()
    work = work or Workload.default(run)
    if work.samples != run.rollouts_per_step:
        work = work.with_samples(run.rollouts_per_step)
    times = phase_times(ideal_phases(run, profile, work, dtype), costs, actor_share(run, profile))
    step, phases, crit = combine(times, engine_batches=len(engine_batches(run, work)),
                                 disaggregated=run.rollout.mode == "disaggregated",
                                 max_off_policy_steps=run.rollout.max_off_policy_steps,
                                 rebalance_before_wait=costs.rebalance_before_wait)
    bounding = max(crit, key=lambda k: crit[k])
    return StepPrediction(phases, step, bounding, crit, describe(run, profile))
