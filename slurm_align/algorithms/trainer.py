"""The training loop shared by SFT, reward-model and DPO training.

Per step: this DP rank's share of the global batch (a pure function of the step, so resume is
exact), split into micro-batches (by sample count or token budget, packed or padded to one
length: make_microbatches); megatron's schedule runs forward/backward
over TP/PP; gradients are summed over the DP group (losses are pre-normalised by the global
count); global-norm clipping; AdamW. Metrics are reduced to every rank; rank 0 prints them and
appends them to RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import DataOrder
from slurm_align.models.checkpoint import find_latest, load_checkpoint, load_weights, save_checkpoint
from slurm_align.models.forward import run_schedule
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import attach_configured, lora_base, trainable_parameters
from slurm_align.models.moe_stats import RouterStats
from slurm_align.models.optimizer import optimizer_step
from slurm_align.models.packing import Batching, PackedLayout, run_batching
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.profiling.metrics import MetricsLogger
from slurm_align.rundir import RunDir


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


class Trainer:
    def __init__(self, run: RunConfig, pctx: Any, run_dir: Path, algo, *, console: Console | None = None):
        self.run, self.pctx, self.algo = run, pctx, algo
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.console = console or Console(stderr=True)
        self.metrics = MetricsLogger(run, self.run_dir, enabled=self.rank == 0)
        tc = run.trainer
        if tc.global_batch_size % pctx.dp_size:
            raise ConfigError.at("trainer.global_batch_size", tc.global_batch_size,
                                 f"must be a multiple of data_parallel={pctx.dp_size}")
        if run.data.train_path is None:
            raise ConfigError.at("data.train_path", None, f"{algo.name} needs a JSONL training file")
        tok = build_tokenizer(run.model)
        cols = run.data.columns
        self.train_ds = algo.dataset(run.data.train_path, tok, run.model.max_seq_len, cols)
        self.val_ds = algo.dataset(run.data.val_path, tok, run.model.max_seq_len, cols) if run.data.val_path else None
        self.chunks = build_gpt(run.model, pctx, value_head=algo.value_head, seed=run.seed)
        if run.model.init_checkpoint:
            load_weights(run.model.init_checkpoint, self.chunks)
        attach_configured(self.chunks, run.model, pctx, run.seed)   # LoRA: on the loaded base
        # MoE: per-expert load and the load-balancing loss in the step's metrics
        self.router_stats = RouterStats(self.chunks, run.model.num_experts) if run.model.num_experts else None
        algo.setup(self)
        self.params = trainable_parameters(self.chunks)   # LoRA: the adapters only
        self.device = self.params[0].device  # collectives run here (gloo: CPU, NCCL: the GPU)
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, weight_decay=tc.weight_decay)
        self.order = DataOrder(len(self.train_ds), tc.global_batch_size, run.seed)
        self.ckpt_root = RunDir(self.run_dir).checkpoints(algo.name)
        self.step = 0
        # Items are samples (sft) or pairs (rm, dpo: two sequences each).
        self.batching = run_batching(run, "actor", tc.micro_batch_size, sequences_per_item=2 if algo.pairs else 1)

    # --- one step -------------------------------------------------------------
    def _global_norm(self, microbatches) -> float:
        t = torch.tensor(self.algo.local_norm(microbatches), dtype=torch.float64, device=self.device)
        if self.pctx.dp_size > 1:
            dist.all_reduce(t, group=self.pctx.dp_group)
        return max(float(t), 1.0)

    def _reduce_sums(self, infos: list[dict]) -> dict:
        """Sum the last stage's per-micro-batch sums over micro-batches, DP and PP."""
        obj: list[list[str] | None] = [sorted(infos[0]) if infos else None]
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

    def train_step(self, step: int) -> dict:
        for c in self.chunks:
            c.train()
        idx = self.order.rank_indices(step, self.pctx.dp_rank, self.pctx.dp_size)
        mbs = make_microbatches(self.train_ds, idx, self.batching, fixed_shape=self.pctx.pp_size > 1)
        norm = self._global_norm(mbs)
        for mb in mbs:
            mb["norm"] = norm
        self.algo.prepare(self, mbs)
        self.optimizer.zero_grad(set_to_none=False)
        infos = run_schedule(self.chunks, mbs, self.algo.loss, forward_only=False)
        grad_norm = optimizer_step(self.optimizer, self.pctx, self.run.trainer.grad_clip)
        metrics = self.algo.metrics(self._reduce_sums(infos))
        metrics["grad_norm"] = grad_norm
        if self.router_stats is not None:
            metrics.update(self.router_stats.collect())
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.val_ds is None:
            return {}
        for c in self.chunks:
            c.eval()
        n = len(self.val_ds) - len(self.val_ds) % self.pctx.dp_size
        per = n // self.pctx.dp_size
        idx = list(range(self.pctx.dp_rank * per, (self.pctx.dp_rank + 1) * per))
        mbs = make_microbatches(self.val_ds, idx, self.batching, fixed_shape=self.pctx.pp_size > 1)
        norm = self._global_norm(mbs)
        for mb in mbs:
            mb["norm"] = norm
        self.algo.prepare(self, mbs)
        infos = run_schedule(self.chunks, mbs, self.algo.loss, forward_only=True)
        out = self.algo.metrics(self._reduce_sums(infos))
        if self.router_stats is not None:
            out.update(self.router_stats.collect())
        return {f"val_{k}": v for k, v in out.items()}

    # --- the loop ---------------------------------------------------------------
    def save(self) -> Path:
        return save_checkpoint(self.ckpt_root, self.step, self.chunks, self.optimizer,
                               {"consumed_samples": self.step * self.run.trainer.global_batch_size,
                                "algorithm": self.algo.name, **lora_base(self.run.model, self.run.seed)})

    def resume(self) -> bool:
        latest = find_latest(self.ckpt_root)
        if latest is None:
            return False
        common = load_checkpoint(latest, self.chunks, self.optimizer)
        self.step = int(common["step"])
        torch.set_rng_state(common["rng"])
        self.metrics.start_at(self.step + 1)   # steps after the checkpoint are redone
        self._print(f"resumed from {latest} at step {self.step}")
        return True

    def _print(self, text: str) -> None:
        if self.rank == 0:
            self.console.print(text, highlight=False)

    def fit(self) -> dict:
        tc = self.run.trainer
        self.resume()
        last: dict = {}
        with Progress(TextColumn(f"[bold]{self.algo.name}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.description}"),
                      console=self.console, disable=self.rank != 0) as progress:
            task = progress.add_task("", total=tc.num_steps, completed=self.step)
            while self.step < tc.num_steps:
                t0 = time.perf_counter()
                metrics = self.train_step(self.step)
                self.step += 1
                record = {"step": self.step, **metrics, "step_time_s": time.perf_counter() - t0}
                if tc.eval_interval and self.step % tc.eval_interval == 0 and self.step < tc.num_steps:
                    record.update(self.evaluate())
                if self.step == tc.num_steps:
                    record.update(self.evaluate())
                self.metrics.log(record)
                progress.update(task, advance=1, description=" ".join(
                    f"{k}={v:.4g}" for k, v in record.items() if k not in ("step", "step_time_s")))
                if (tc.save_interval and self.step % tc.save_interval == 0) or self.step == tc.num_steps:
                    self.save()
                last = record
        self.metrics.close()
        self._print(f"{self.algo.name} done: " + " ".join(f"{k}={v:.4g}" for k, v in last.items()))
        return last
