"""The one optimizer of every trained model (the SFT/RM/DPO trainers, the PPO actor, the critic),
built in one place (`build_optimizer`) from the run's `training:` section: Adam(W) with its
betas/eps, weight decay and global-norm gradient clipping, megatron-core's
OptimizerParamScheduler for the LR (warmup, constant/linear/cosine decay, min LR), and one of
two layouts of the weights the update is made on:

- direct (fp32, distributed_optimizer off): Adam updates the model's own fp32 parameters;
  gradients are summed over data parallelism by one flat all-reduce (`reduce_gradients`);
- flat (bf16/fp16, or distributed_optimizer on): megatron's mixed-precision / distributed-optimizer
  recipe. Every parameter's gradient is accumulated in fp32 (`param.main_grad`, a view of one
  flat fp32 buffer per DP group: a hook adds each backward's `.grad` to it and drops the
  `.grad`); the update is made on fp32 main weights; with distributed_optimizer (ZeRO-1) the
  main weights and Adam state are sharded over the DP group: gradients are reduce-scattered,
  each rank updates its 1/DP, the updated weights are all-gathered into the parameters.

fp16 adds megatron's dynamic loss scaling (megatron.core.optimizer.grad_scaler.DynamicGradScaler,
its own class; on CPU its 'cuda' tensors are redirected by cpu_compat): the schedule multiplies
the loss by the scale before the backward pass (TransformerConfig.grad_scale_func, as megatron's
training loop sets it), the reduced fp32 gradients are divided by it; a step whose gradient norm
is inf/nan (the norm is reduced over every group, so all ranks agree) is skipped: no update, no
LR-schedule step, the scaler told so (it halves the scale after `loss_scale_hysteresis` such
steps in a row and doubles it after `loss_scale_window` clean ones).

Why not megatron's own DistributedDataParallel + DistributedOptimizer: in megatron-core 0.16.1
(read in this venv) they need (1) the model wrapped in megatron's DDP, whose contiguous
param/grad buffers own every parameter: the LoRA adapters live outside the module tree
(models/lora.py) and would be left out, the tied-embedding copy under PP and the critic's
host<->device model swap replace `.data`; checkpoint, refit and export paths all name the
unwrapped modules; and (2) on CPU, beyond buffers allocated on `torch.cuda.current_device()`
(which cpu_compat's stand-in can redirect), tensor *type strings*:
`distrib_optimizer.py:361,420` tests `model_param.type()` against 'torch.cuda.HalfTensor' /
'torch.cuda.FloatTensor' (a CPU fp32 param raises at :431), `clip_grads.py:167` asserts
`param.grad.type() == 'torch.cuda.FloatTensor'`: patching those means replacing megatron
functions, not redirecting a module's `torch`. The same step here runs on CPU (gloo:
reduce_scatter_tensor and all_gather_into_tensor) and GPU (NCCL), one code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from slurm_align.config.run import TrainingConfig
from slurm_align.models.cpu_compat import apply_cpu_compat
from slurm_align.models.weights import sync_tied_embedding_grads


def _counts_in_norm(p: torch.Tensor, pctx: Any) -> bool:
    """TP-replicated params are counted once (TP rank 0); a tied embedding's last-stage copy
    not at all (its first-stage twin is)."""
    return (getattr(p, "tensor_model_parallel", False) or pctx.tp_rank == 0) and not getattr(p, "tied_copy", False)


def _is_expert(p: torch.Tensor, pctx: Any) -> bool:
    """MoE under expert parallelism: megatron marks expert weights allreduce=False; their
    replicas are the DP / EP ranks holding the same experts."""
    return getattr(pctx, "ep_size", 1) > 1 and not getattr(p, "allreduce", True)


def _global_norm(sq_dense: torch.Tensor, sq_experts: torch.Tensor, pctx: Any) -> float:
    """The gradient norm over TP x PP (x EP for experts) from this rank's sums of squares."""
    if getattr(pctx, "ep_size", 1) > 1:
        dist.all_reduce(sq_experts, group=pctx.ep_group)  # each EP rank holds other experts
    sq = sq_dense + sq_experts
    if pctx.tp_size * pctx.pp_size > 1:
        dist.all_reduce(sq, group=pctx.mp_group)
    return math.sqrt(float(sq))


def reduce_gradients(params: list, pctx: Any, clip: float | None) -> float:
    """Sum `.grad` over DP (one flat all-reduce), clip them to the global norm over TP x PP and
    return that norm. Parameters without a gradient get zeros, so every rank joins the same
    collectives. The direct layout's reduction (ModelOptimizer.step)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sync_tied_embedding_grads(params)  # tied embeddings under PP > 1: first + last stage
    grads = [p.grad for p in params]
    expert = [_is_expert(p, pctx) for p in params]
    for part, group, size in (([g for g, e in zip(grads, expert) if not e], pctx.dp_group, pctx.dp_size),
                              ([g for g, e in zip(grads, expert) if e], getattr(pctx, "edp_group", None),
                               pctx.dp_size // getattr(pctx, "ep_size", 1))):
        if part and size > 1:
            flat = torch._utils._flatten_dense_tensors(part)
            dist.all_reduce(flat, group=group)
            for g, r in zip(part, torch._utils._unflatten_dense_tensors(flat, part)):
                g.copy_(r)
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    sq_experts = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for p, e in zip(params, expert):
        if _counts_in_norm(p, pctx):
            (sq_experts if e else sq).add_(p.grad.double().pow(2).sum())
    norm = _global_norm(sq, sq_experts, pctx)
    if clip and norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))
    return norm


@dataclass
class FlatBucket:
    """The parameters that share one DP group (all of them; or, under expert parallelism, the
    experts, whose group is the expert-DP group), laid end to end in one flat fp32 gradient
    buffer padded to a multiple of `shards`; this rank updates [start, start + shard_size)."""

    params: list
    group: Any
    group_size: int      # ranks the gradients are summed over
    shards: int          # ranks the main weights / Adam state are split over (group_size or 1)
    shard_rank: int
    offsets: list[int]
    numel: int
    shard_size: int
    grads: torch.Tensor  # fp32 [shards * shard_size]; each param's main_grad is a view of it
    main: torch.Tensor   # fp32 main weights of this rank's shard (an Adam parameter)
    expert: bool         # MoE experts under EP (their norm is summed over the EP group too)
    norm_ranges: list[tuple[int, int]] = field(default_factory=list)  # shard positions in the norm

    @property
    def start(self) -> int:
        return self.shard_rank * self.shard_size

    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """[shards * shard_size] from every rank's `shard` (collective when sharded)."""
        if self.shards == 1:
            return shard
        full = shard.new_empty(self.shards * self.shard_size)
        dist.all_gather_into_tensor(full, shard.contiguous(), group=self.group)
        return full


def _accumulate_main_grad(p: Any) -> None:   # a Parameter that _make_bucket gave a main_grad
    """Post-accumulate hook: the backward's gradient (bf16 in bf16 training) is added to the fp32
    main_grad and dropped, so micro-batches accumulate in fp32 as megatron's DDP does."""
    assert p.grad is not None, "called by autograd after accumulating a gradient"
    p.main_grad.add_(p.grad)
    p.grad = None


def _make_bucket(params: list, group: Any, size: int, sharded: bool, pctx: Any, expert: bool) -> FlatBucket:
    shards = size if sharded else 1
    shard_rank = dist.get_rank(group=group) if shards > 1 else 0
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    shard_size = -(-n // shards)
    device = params[0].device
    grads = torch.zeros(shards * shard_size, dtype=torch.float32, device=device)
    flat = torch.zeros(shards * shard_size, dtype=torch.float32, device=device)
    start = shard_rank * shard_size
    norm_ranges = []
    for p, off in zip(params, offsets):
        flat[off:off + p.numel()] = p.detach().reshape(-1).float()
        p.main_grad = grads[off:off + p.numel()].view_as(p)
        p.register_post_accumulate_grad_hook(_accumulate_main_grad)
        lo, hi = max(off, start) - start, min(off + p.numel(), start + shard_size) - start
        if lo < hi and _counts_in_norm(p, pctx):
            norm_ranges.append((lo, hi))
    main = flat[start:start + shard_size].clone()
    return FlatBucket(params, group, size, shards, shard_rank, offsets, n, shard_size, grads, main, expert,
                      norm_ranges)


class ModelOptimizer:
    """One trained model's optimizer (see the module docstring). `step()` reduces the gradients,
    clips them, updates, and advances the LR schedule; it returns the gradient norm before
    clipping. Collective over the model's DP and model-parallel groups."""

    def __init__(self, params: list, pctx: Any, training: TrainingConfig, *, lr: float, weight_decay: float,
                 grad_clip: float, total_steps: int, models: list | None = None):
        self.params, self.pctx, self.training, self.grad_clip = list(params), pctx, training, grad_clip
        self.scaler: DynamicGradScaler | None = None
        self.skipped_steps = 0   # fp16: steps skipped for inf/nan gradients
        if training.precision == "fp16":
            if not models:
                raise ValueError("precision fp16: build_optimizer needs the model chunks (models=...), whose "
                                 "schedule scales the loss")
            apply_cpu_compat()   # the scaler's tensors are made on 'cuda'
            self.scaler = DynamicGradScaler(
                initial_scale=training.initial_loss_scale, min_scale=training.min_loss_scale, growth_factor=2.0,
                backoff_factor=0.5, growth_interval=training.loss_scale_window,
                hysteresis=training.loss_scale_hysteresis)
            for chunk in models:   # megatron's schedule: backward of grad_scale_func(loss)
                chunk.config.grad_scale_func = self.scale_loss
        self.flat = training.precision != "fp32" or training.distributed_optimizer
        self.buckets: list[FlatBucket] = []
        if self.flat:
            dense = [p for p in self.params if not _is_expert(p, pctx)]
            experts = [p for p in self.params if _is_expert(p, pctx)]
            for part, group, size, expert in ((dense, pctx.dp_group, pctx.dp_size, False),
                                              (experts, getattr(pctx, "edp_group", None),
                                               pctx.dp_size // getattr(pctx, "ep_size", 1), True)):
                if part:
                    self.buckets.append(_make_bucket(part, group, size, training.distributed_optimizer, pctx,
                                                     expert))
            trained = [b.main for b in self.buckets]
        else:
            trained = self.params
        self.optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay,
                                           betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps)
        decay_steps = training.lr_decay_steps or max(total_steps, training.lr_warmup_steps + 1)
        # megatron's scheduler: step k (from 0) runs at the LR of num_steps = k.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=min(training.lr_warmup_init, lr), max_lr=lr, min_lr=min(training.min_lr, lr),
            lr_warmup_steps=training.lr_warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=training.lr_decay_style, start_wd=weight_decay, end_wd=weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant")

    @property
    def lr(self) -> float:
        """The LR of the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def steps(self) -> int:
        """Updates made so far (Adam's count, which its bias correction uses)."""
        for pstate in self.optimizer.state.values():
            if "step" in pstate:
                return int(pstate["step"])
        return 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.grads.zero_()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: the loss times the current loss scale (what the backward pass starts from)."""
        assert self.scaler is not None, "set as grad_scale_func for fp16 only"
        return loss * self.scaler.scale.to(loss.device)

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.scale) if self.scaler is not None else None

    def metrics(self) -> dict[str, float]:
        """fp16: the loss scale of the next step and the steps skipped so far (nothing else)."""
        if self.scaler is None:
            return {}
        return {"loss_scale": float(self.scaler.scale), "skipped_steps": float(self.skipped_steps)}

    def scaler_state(self) -> dict | None:
        """fp16: what a checkpoint keeps of the loss scaler (plain numbers)."""
        if self.scaler is None:
            return None
        return {"scale": float(self.scaler.scale), "growth_tracker": int(self.scaler._growth_tracker),
                "hysteresis_tracker": int(self.scaler._hysteresis_tracker), "skipped_steps": self.skipped_steps}

    def load_scaler_state(self, state: dict) -> None:
        """Restore scaler_state(); the fields megatron's own load_state_dict sets (which moves
        the scale with `.cuda()`, refused on CPU)."""
        if self.scaler is None:
            return
        self.scaler._scale = torch.full_like(self.scaler.scale, state["scale"])
        self.scaler._growth_tracker = int(state["growth_tracker"])
        self.scaler._hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skipped_steps = int(state["skipped_steps"])

    def step(self) -> float:
        norm = self._flat_reduce() if self.flat else reduce_gradients(self.params, self.pctx, self.grad_clip)
        if self.scaler is not None:
            found_inf = not math.isfinite(norm)
            self.scaler.update(found_inf)
            if found_inf:   # megatron: no update and no scheduler step
                self.skipped_steps += 1
                for b in self.buckets:
                    b.main.grad = None
                return norm
        self.optimizer.step()
        if self.flat:
            self._write_back()
        self.scheduler.step(1)
        return norm

    # --- the flat layout -------------------------------------------------------------------
    def _flat_reduce(self) -> float:
        """Sum main grads over DP (reduce-scatter: each rank gets its shard's sum), clip them to
        the global norm and hand this rank's shard to Adam as its main weights' gradient."""
        tied = [p for p in self.params if getattr(p, "tied_embedding", False)]
        for p in tied:   # tied embeddings under PP > 1: first + last stage
            dist.all_reduce(p.main_grad, group=parallel_state.get_embedding_group())
        device = self.buckets[0].grads.device
        sq = {False: torch.zeros((), dtype=torch.float64, device=device),
              True: torch.zeros((), dtype=torch.float64, device=device)}
        shard_grads = []
        for b in self.buckets:
            if b.shards > 1:
                g = torch.empty(b.shard_size, dtype=torch.float32, device=device)
                dist.reduce_scatter_tensor(g, b.grads, group=b.group)
            else:
                if b.group_size > 1:
                    dist.all_reduce(b.grads, group=b.group)
                g = b.grads
            if self.scaler is not None:   # fp16: the gradients of the scaled loss, unscaled in fp32
                g.mul_(self.scaler.inv_scale.to(device))
            part = torch.zeros((), dtype=torch.float64, device=device)
            for lo, hi in b.norm_ranges:
                part += g[lo:hi].double().pow(2).sum()
            if b.shards > 1:   # the other DP ranks hold the rest of the bucket
                dist.all_reduce(part, group=b.group)
            sq[b.expert] += part
            shard_grads.append(g)
        norm = _global_norm(sq[False], sq[True], self.pctx)
        scale = self.grad_clip / (norm + 1e-6) if self.grad_clip and norm > self.grad_clip else 1.0
        for b, g in zip(self.buckets, shard_grads):
            b.main.grad = g * scale if scale != 1.0 else g
        return norm

    @torch.no_grad()
    def _write_back(self) -> None:
        """Updated main weights -> the parameters (all-gathered over the DP group when sharded),
        in the parameters' dtype."""
        for b in self.buckets:
            b.main.grad = None
            full = b.gather_full(b.main.to(b.params[0].dtype))
            for p, off in zip(b.params, b.offsets):
                p.copy_(full[off:off + p.numel()].view_as(p))

    # --- checkpoints: per-parameter state, whatever the layout ------------------------------
    def state_keys(self) -> list[str]:
        """Per-parameter optimizer state a checkpoint holds: Adam's moments, and the fp32 main
        weights where the parameters are not fp32 (fp32 ones equal the parameters)."""
        return ["exp_avg", "exp_avg_sq"] + (["main_param"] if self.training.precision != "fp32" else [])

    def per_param_state_dict(self) -> dict:
        """The state as torch's per-parameter optimizer state dict over `self.params` (ids in
        order), full tensors shaped like each parameter on every DP rank, independent of the DP
        size and of sharding (collective over the DP group when sharded)."""
        if not self.flat:
            return self.optimizer.state_dict()
        state: dict[int, dict] = {i: {"step": torch.tensor(float(self.steps))} for i in range(len(self.params))}
        ids = {id(p): i for i, p in enumerate(self.params)}
        for b in self.buckets:
            inner = self.optimizer.state.get(b.main, {})
            sources = {"exp_avg": inner.get("exp_avg"), "exp_avg_sq": inner.get("exp_avg_sq"), "main_param": b.main}
            for key in self.state_keys():
                src = sources[key]
                full = b.gather_full(src if src is not None else torch.zeros_like(b.main))
                for p, off in zip(b.params, b.offsets):
                    state[ids[id(p)]][key] = full[off:off + p.numel()].view(p.shape).clone()
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(self.params)))}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def empty_per_param_state_dict(self) -> dict:
        """Zero per-parameter state of the right shapes: what a checkpoint is loaded into."""
        state = {i: {"step": torch.tensor(0.0), **{k: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                                                   for k in self.state_keys()}}
                 for i, p in enumerate(self.params)}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(self.params)))}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_per_param_state_dict(self, osd: dict, steps: int) -> None:
        """Load what per_param_state_dict saved (any DP size, either layout of fp32 runs); this
        rank keeps its shard. `steps`: Adam's update count."""
        if not self.flat:
            for pstate in osd["state"].values():
                pstate["step"] = torch.tensor(float(steps))
            self.optimizer.load_state_dict(osd)
            return
        ids = {id(p): i for i, p in enumerate(self.params)}
        for b in self.buckets:
            full = {k: torch.zeros(b.shards * b.shard_size, dtype=torch.float32, device=b.main.device)
                    for k in ("exp_avg", "exp_avg_sq", "main_param")}
            for p, off in zip(b.params, b.offsets):
                pstate = osd["state"][ids[id(p)]]
                for k in full:
                    # fp32 weights are their own main weights (checkpoints of fp32 runs hold none)
                    src = pstate[k] if k in pstate else p.detach().float()
                    full[k][off:off + p.numel()] = src.reshape(-1).float()
            shard = slice(b.start, b.start + b.shard_size)
            b.main.copy_(full["main_param"][shard])
            self.optimizer.state[b.main] = {"step": torch.tensor(float(steps)),
                                            "exp_avg": full["exp_avg"][shard].clone(),
                                            "exp_avg_sq": full["exp_avg_sq"][shard].clone()}
        self._write_back()


def build_optimizer(params: list, pctx: Any, training: TrainingConfig, *, lr: float, weight_decay: float = 0.0,
                    grad_clip: float = 0.0, total_steps: int = 1, models: list | None = None) -> ModelOptimizer:
    """THE optimizer of every trained model: `params` are what trains (a LoRA model's adapters,
    every parameter otherwise); `lr`, `weight_decay` and `grad_clip` are the model's own;
    `total_steps` (the run's optimizer steps) is the default end of the LR decay; `models`: the
    model's chunks (fp16 sets their loss scaling; needed then)."""
    return ModelOptimizer(params, pctx, training, lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                          total_steps=total_steps, models=models)
