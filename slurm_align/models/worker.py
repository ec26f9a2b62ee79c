"""The model worker: one model that trains (or scores) with any registered loss (losses/).

It builds the model from the config (megatron-core GPT, LM or value head), loads its weights
(an init checkpoint; Hugging Face through build_gpt), attaches LoRA, holds the frozen reference
policy when the loss needs one, builds the optimizer (in ONE place: `_build_optimizer`), saves
and resumes, and offers

    train(ds, indices, loss)     one optimizer step over the items `indices` of `ds`
    evaluate(ds, indices, loss)  the same forward pass without a step

with micro-batching (make_microbatches: sample count or token budget, packed or padded), the
global loss normaliser (the loss's counts summed over micro-batches and DP ranks), the
reference log-probs, megatron's forward/backward schedule over TP/PP, the optimizer step and the
reduction of the loss's metric sums over micro-batches, DP and PP. The SFT / RM / DPO trainer
(algorithms/trainer.py) is a thin loop over it; so are the RL actor's update
(algorithms/policy_gradient.PolicyUpdate: algorithms/rollout_losses.py over rollouts, the worker built by
algorithms/ppo.build_actor) and the critic's value training (critic/worker.py: losses/value.py,
`ModelWorker.around` its value model, which the critic swaps with its reward model).

A data set hands the worker its items one of two ways: `item_tokens(indices)` + `batch(items)`
(the trainers' JSONL data sets: make_microbatches forms the micro-batches), or
`loss_microbatches(indices, batching, columns, fixed_shape=)` (rollouts, the critic's value
targets: data that forms its own micro-batches with the loss's per-token columns).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurm_align.config.run import ModelConfig, TrainingConfig
from slurm_align.models.checkpoint import (
    AsyncCheckpointWriter,
    find_latest,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from slurm_align.models.forward import run_schedule, sequence_token_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import AdaptersOff, attach_configured, reference_policy, trainable_parameters
from slurm_align.models.moe_stats import RouterStats
from slurm_align.models.optimizer import build_optimizer
from slurm_align.models.packing import Batching, PackedLayout
from slurm_align.models.weights import HostSwap


def make_microbatches(ds, indices: list[int], batching: Batching | int, *, fixed_shape: bool = True) -> list[dict]:
    """Micro-batches of the step's items (samples, or pairs for rm/dpo), formed by `batching`
    (models/packing.py: sample count or token budget, padded or packed). Each holds
    ds.batch(...) of its items plus "real" [items] (0 on filler items).

    Padded: every micro-batch padded to the longest sequence of the step; with `fixed_shape`
    (the pipeline's p2p buffers need one shape per step) micro-batches with fewer items are
    filled up with copies of their last item (real 0, mask 0). Packed: tokens become packed rows
    ("packing": their layout), one shape for all with `fixed_shape`."""
    if isinstance(batching, int):
        batching = Batching(micro_batch_size=batching)
    groups = [[indices[i] for i in g] for g in batching.groups(ds.item_tokens(indices))]
    most = max(len(g) for g in groups) if fixed_shape and not batching.pack else 0
    mbs = []
    for g in groups:
        mb = ds.batch(g + g[-1:] * (most - len(g)))
        mb["real"] = (torch.arange(max(most, len(g))) < len(g)).float()
        mb["index"] = torch.tensor(g + g[-1:] * (most - len(g)))   # the items' indices in ds
        per_seq = mb["real"].repeat(mb["tokens"].shape[0] // len(mb["real"]))   # pairs: chosen, then rejected
        mb["mask"] = mb["mask"] * per_seq[:, None]
        mbs.append(mb)
    if batching.pack:
        width = max(int(mb["lengths"].max()) for mb in mbs) if fixed_shape else None
        layouts = [PackedLayout.plan(mb["lengths"], width=width) for mb in mbs]
        rows = max(lay.rows for lay in layouts) if fixed_shape else None
        for mb, lay in zip(mbs, layouts):
            if rows is not None:
                lay = PackedLayout(lay.lengths, lay.row, lay.offset, rows, lay.width)
            mb["tokens"], mb["packing"] = lay.pack(mb["tokens"], ds.pad_id), lay
        return mbs
    length = max(mb["tokens"].shape[1] for mb in mbs)
    for mb in mbs:
        extra = length - mb["tokens"].shape[1]
        if extra:
            pad = mb["tokens"].new_full((mb["tokens"].shape[0], extra), ds.pad_id)
            mb["tokens"] = torch.cat([mb["tokens"], pad], 1)
            mb["mask"] = torch.cat([mb["mask"], mb["mask"].new_zeros((mb["mask"].shape[0], extra))], 1)
    return mbs


class ModelWorker:
    """One trained model on this rank's TP/PP/DP position (see the module docstring)."""

    def __init__(self, model: ModelConfig, pctx: Any, *, seed: int, value_head: bool = False,
                 reference: bool = False, lr: float = 1e-3, weight_decay: float = 0.0, grad_clip: float = 1.0,
                 batching: Batching | int = 8, training: TrainingConfig | None = None, total_steps: int = 1,
                 router_stats: bool = True):
        self.model_cfg: ModelConfig | None = model
        self.pctx, self.seed = pctx, seed
        self.grad_clip, self.batching = grad_clip, batching
        training = training or TrainingConfig()
        self.chunks = build_gpt(model, pctx, value_head=value_head, seed=seed, training=training)
        # an iter_* folder, or a trainer's checkpoints folder (then its newest complete one), as
        # the RL actor takes it (algorithms/ppo.build_actor)
        self.init_checkpoint = (find_latest(model.init_checkpoint) or Path(model.init_checkpoint)
                                if model.init_checkpoint else None)
        if self.init_checkpoint is not None:
            load_weights(self.init_checkpoint, self.chunks)
        attach_configured(self.chunks, model, pctx, seed)   # LoRA: on the loaded base
        # MoE: per-expert load and the load-balancing loss in the step's metrics
        # (router_stats=False: the user collects them itself, over more than the update: the RL actor)
        self.router_stats = (RouterStats(self.chunks, model.num_experts) if model.num_experts and router_stats
                             else None)
        # The frozen reference is the initial policy, taken after the init weights are loaded and
        # before any resume: a host copy swapped in for its forward pass, or LoRA's adapters off.
        self.reference: HostSwap | AdaptersOff | None = reference_policy(self.chunks) if reference else None
        self.params = trainable_parameters(self.chunks)   # LoRA: the adapters only
        self.device = self.params[0].device  # collectives run here (gloo: CPU, NCCL: the GPU)
        self.optimizer = build_optimizer(self.params, pctx, training, lr=lr, weight_decay=weight_decay,
                                         grad_clip=grad_clip, total_steps=total_steps, models=self.chunks)

    @classmethod
    def around(cls, chunks: list, optimizer: Any, pctx: Any, model: ModelConfig | None, *, batching: Batching | int,
               reference: HostSwap | AdaptersOff | None = None) -> ModelWorker:
        """The worker's step over a model built elsewhere (the critic's value model, which it
        swaps with its reward model through host memory): no loading, no LoRA, no router stats."""
        self = cls.__new__(cls)
        self.model_cfg, self.pctx, self.seed = model, pctx, 0
        self.batching, self.grad_clip = batching, 0.0
        self.chunks, self.optimizer, self.reference = chunks, optimizer, reference
        self.init_checkpoint, self.router_stats = None, None
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.device = self.params[0].device
        return self

    # --- one step ---------------------------------------------------------------------------
    def microbatches(self, ds, indices: list[int], loss=None) -> list[dict]:
        if not len(indices):
            return []
        fixed = self.pctx.pp_size > 1
        own = getattr(ds, "loss_microbatches", None)
        if own is not None:   # rollouts, value targets: per-token columns the loss names
            columns = (*loss.columns, *loss.optional_columns) if loss is not None else ()
            return own(indices, self.batching, columns, fixed_shape=fixed)
        return make_microbatches(ds, indices, self.batching, fixed_shape=fixed)

    def _prepare(self, mbs: list[dict], loss) -> float:
        """Check the loss's columns, put the global normaliser in every micro-batch and, when
        the loss needs them, the reference policy's per-token log-probs. Returns the global
        count (the loss's `count` summed over micro-batches and DP ranks)."""
        missing = sorted({c for mb in mbs for c in loss.columns if c not in mb})
        if missing:
            raise ValueError(f"loss {loss.name!r} reads micro-batch column(s) {missing}; the data set gives "
                             f"{sorted(mbs[0])}")
        t = torch.tensor(sum(loss.count(mb) for mb in mbs), dtype=torch.float64, device=self.device)
        if self.pctx.dp_size > 1:
            dist.all_reduce(t, group=self.pctx.dp_group)
        norm = max(float(t), 1.0)
        for mb in mbs:
            mb["norm"] = norm
        if loss.reference and mbs:
            self._reference_logprobs(mbs)
        return float(t)

    @torch.no_grad()
    def _reference_logprobs(self, mbs: list[dict]) -> None:
        """mb["ref_logp"] [b, s-1] (last stage) with the reference weights swapped in."""
        def ref(output, mb):
            assert self.model_cfg is not None, "a worker around a policy knows its model config"
            return output.new_zeros(()), {"ref_logp": sequence_token_logprobs(output, mb, self.model_cfg.vocab_size)}
        if self.reference is None:
            raise ValueError("this loss needs the reference policy: build the worker with reference=True")
        self.reference.swap()
        try:
            infos = run_schedule(self.chunks, mbs, ref, forward_only=True)
        finally:
            self.reference.swap()
        for mb, info in zip(mbs, infos):
            mb["ref_logp"] = info["ref_logp"]

    def _reduce_sums(self, infos: list[dict], loss) -> dict:
        """Sum the last stage's per-micro-batch sums over micro-batches, DP and PP."""
        obj: list[list[str] | None] = [sorted(infos[0]) if infos else (sorted(loss.sum_keys) or None)]
        if self.pctx.pp_size > 1:  # non-last stages learn the keys from the last stage
            src = dist.get_global_rank(self.pctx.pp_group, self.pctx.pp_size - 1)
            dist.broadcast_object_list(obj, src=src, group=self.pctx.pp_group)
        keys = obj[0]
        assert keys is not None, "the last stage has the micro-batches' sums"
        vec = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        for info in infos:
            vec += torch.stack([info[k].detach().double().to(self.device) for k in keys])
        if self.pctx.dp_size > 1:
            dist.all_reduce(vec, group=self.pctx.dp_group)
        if self.pctx.pp_size > 1:
            dist.all_reduce(vec, group=self.pctx.pp_group)
        return dict(zip(keys, vec.cpu()))

    def _run(self, ds, indices: list[int], loss, *, train: bool) -> dict:
        for c in self.chunks:
            c.train(train)
        mbs = self.microbatches(ds, indices, loss)
        total = self._prepare(mbs, loss)
        if total == 0 and loss.sum_keys:
            mbs = []   # nothing counts on any DP rank: no forward (its zero gradients), still the step
        if train:
            self.optimizer.zero_grad()
        infos = run_schedule(self.chunks, mbs, loss, forward_only=not train) if mbs else []
        lr = self.optimizer.lr   # this step's
        # every rank joins the gradient all-reduce, also with nothing to train on (zero grads)
        grad_norm = self.optimizer.step() if train else None
        metrics = loss.metrics(self._reduce_sums(infos, loss))
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
            metrics["lr"] = lr
            metrics.update(self.optimizer.metrics())   # fp16: loss_scale, skipped_steps
        if self.router_stats is not None:
            metrics.update(self.router_stats.collect())
        return metrics

    def train(self, ds, indices: list[int], loss) -> dict:
        """One optimizer step on this rank's items `indices` of `ds` (every DP rank calls it with
        its own share); the loss's metrics over the global batch, plus grad_norm."""
        return self._run(ds, indices, loss, train=True)

    @torch.no_grad()
    def evaluate(self, ds, indices: list[int], loss) -> dict:
        """The loss's metrics over the items (this rank's share), without a step."""
        return self._run(ds, indices, loss, train=False)

    @torch.no_grad()
    def forward(self, ds, indices: list[int], fn, *, reference: bool = False) -> dict[str, torch.Tensor]:
        """fn(output, mb) -> {name: tensor [items of the micro-batch, ...]} over the items
        `indices` of `ds` (forward only; mb["ref_logp"] too with `reference`), concatenated in
        micro-batch order (token budgets reorder items) with filler items dropped, plus "index":
        each row's item index in ds. Last pipeline stage only ({} elsewhere)."""
        for c in self.chunks:
            c.eval()
        mbs = self.microbatches(ds, indices)
        if reference:
            self._reference_logprobs(mbs)
        def step(out, mb):
            return out.new_zeros(()), {**fn(out, mb), "index": mb["index"]}
        infos = run_schedule(self.chunks, mbs, step, forward_only=True)
        keep = [mb["real"].bool() for mb in mbs]
        keys = list(infos[0]) if infos else []
        return {k: torch.cat([info[k].cpu()[rows] for info, rows in zip(infos, keep)]) for k in keys}

    # --- checkpoints -----------------------------------------------------------------------
    def save(self, root: Path, step: int, common: dict, writer: AsyncCheckpointWriter | None = None,
             on_commit: Callable[[], object] | None = None) -> Path:
        """Collective. With a `writer` it returns once the write is under way (on_commit: rank 0,
        after the commit); without one once committed (then on_commit runs here, on rank 0)."""
        if writer is not None:
            return writer.save(root, step, self.chunks, self.optimizer, common, on_commit)
        path = save_checkpoint(root, step, self.chunks, self.optimizer, common)
        if on_commit is not None and dist.get_rank() == 0:
            on_commit()
        return path

    def resume(self, root: Path) -> tuple[Path, dict] | None:
        """Load the newest complete checkpoint under `root` (weights, optimizer state, RNG);
        (its path, its common state), or None when there is none."""
        latest = find_latest(root)
        if latest is None:
            return None
        common = load_checkpoint(latest, self.chunks, self.optimizer)
        torch.set_rng_state(common["rng"])
        return latest, common
