"""The training loop shared by SFT, reward-model and DPO training: a thin loop over the model
worker (models/worker.py) with the run's registered loss (losses/; RunConfig.loss).

Per step: this DP rank's share of the global batch (a pure function of the step, so resume is
exact) goes to `ModelWorker.train`, which micro-batches it, normalises the loss globally, runs
forward/backward over TP/PP, steps the run's optimizer (models/optimizer.build_optimizer: AdamW, LR
schedule, bf16 / ZeRO-1 as `training:` says) and reduces the loss's metrics to every rank; rank 0
prints them and appends them to RUN_DIR/metrics.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import DataOrder
from slurm_align.data.mixture import training_data
from slurm_align.models.checkpoint import AsyncCheckpointWriter
from slurm_align.models.lora import lora_base
from slurm_align.models.packing import run_batching
from slurm_align.models.retention import apply_retention
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.worker import ModelWorker
from slurm_align.profiling.device import ProfilerWindow
from slurm_align.profiling.metrics import MetricsLogger
from slurm_align.profiling.watchdog import Watchdog
from slurm_align.rundir import RunDir
from slurm_align.slurm.preemption import StopPoint


class Trainer:
    def __init__(self, run: RunConfig, pctx: Any, run_dir: Path, *, console: Console | None = None):
        self.run, self.pctx = run, pctx
        spec, options = run.trainer_loss()
        self.loss = spec.build(options, run.model)
        self.name = run.algorithm
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.console = console or Console(stderr=True)
        self.metrics = MetricsLogger(run, self.run_dir, enabled=self.rank == 0)
        tc = run.trainer
        if tc.global_batch_size % pctx.dp_size:
            raise ConfigError.at("trainer.global_batch_size", tc.global_batch_size,
                                 f"must be a multiple of data_parallel={pctx.dp_size}")
        if run.data.train_path is None and not run.data.mixture:
            raise ConfigError.at("data.train_path", None, f"{self.name} needs a training file (or data.mixture)")
        if self.loss.value_head and run.model.num_labels != self.loss.value_outputs:
            raise ConfigError.at("model.num_labels", run.model.num_labels,
                                 f"loss {spec.name!r} reads {self.loss.value_outputs} output(s) of the value head")
        tok = build_tokenizer(run.model)
        cols = run.data.columns
        cut = run.data.truncate
        self.train_ds = self.loss.dataset(training_data(run), tok, run.model.max_seq_len, cols, cut)
        self.val_ds = (self.loss.dataset(run.data.val_path, tok, run.model.max_seq_len, cols, cut)
                       if run.data.val_path else None)
        # Items are samples (sft) or pairs (rm, dpo: two sequences each).
        batching = run_batching(run, "actor", tc.micro_batch_size, sequences_per_item=2 if self.loss.pairs else 1)
        self.worker = ModelWorker(run.model, pctx, seed=run.seed, value_head=self.loss.value_head,
                                  reference=self.loss.reference, lr=tc.lr, weight_decay=tc.weight_decay,
                                  grad_clip=tc.grad_clip, batching=batching, training=run.training,
                                  total_steps=tc.num_steps)
        self.order = DataOrder(len(self.train_ds), tc.global_batch_size, run.seed)
        self.ckpt_root = RunDir(self.run_dir).checkpoints(self.name)
        self.step = 0
        self._saved_step: int | None = None   # the step of the newest save (under way or committed)
        self.writer = AsyncCheckpointWriter() if run.checkpointing.async_save else None

    @property
    def chunks(self) -> list:
        return self.worker.chunks

    def train_step(self, step: int) -> dict:
        idx = self.order.rank_indices(step, self.pctx.dp_rank, self.pctx.dp_size)
        return self.worker.train(self.train_ds, idx, self.loss)

    def evaluate(self) -> dict:
        if self.val_ds is None:
            return {}
        n = len(self.val_ds) - len(self.val_ds) % self.pctx.dp_size
        per = n // self.pctx.dp_size
        idx = list(range(self.pctx.dp_rank * per, (self.pctx.dp_rank + 1) * per))
        return {f"val_{k}": v for k, v in self.worker.evaluate(self.val_ds, idx, self.loss).items()}

    # --- the loop ---------------------------------------------------------------
    def save(self) -> Path:
        self._saved_step = self.step
        # on_commit: once committed on every rank (the commit's last barrier), older ones may go
        return self.worker.save(self.ckpt_root, self.step,
                                {"consumed_samples": self.step * self.run.trainer.global_batch_size,
                                 "algorithm": self.name,
                                 **lora_base(self.run.model, self.run.seed, self.worker.init_checkpoint)},
                                writer=self.writer, on_commit=lambda: apply_retention(
                                    self.run.checkpointing, self.ckpt_root, self.metrics.path))

    def save_and_wait(self) -> None:
        """This step's checkpoint committed before returning (a stop for preemption): saved now
        unless its (background) save is under way, then the writer joined."""
        if self._saved_step != self.step:
            self.save()
        if self.writer is not None:
            self.writer.wait()

    def resume(self) -> Path | None:
        """Go on from the newest complete checkpoint, if any; it is returned."""
        found = self.worker.resume(self.ckpt_root)
        if found is None:
            return None
        latest, common = found
        self.step = int(common["step"])
        self.metrics.start_at(self.step + 1)   # steps after the checkpoint are redone
        self._print(f"resumed from {latest} at step {self.step}")
        return latest

    def _print(self, text: str) -> None:
        if self.rank == 0:
            self.console.print(text, highlight=False)

    def fit(self, stop: StopPoint | None = None) -> dict:
        """Train to trainer.num_steps, or until `stop` (preemption: train_main's) ends the run
        early after a saved step."""
        tc = self.run.trainer
        resumed = self.resume()
        if stop is not None:
            stop.resumed(self.step + 1, resumed)
        timeout = self.run.fault_tolerance.hang_timeout_s
        watchdog = Watchdog(timeout, RunDir(self.run_dir).logs / "actor", self.rank).start() if timeout else None
        trace = Path(self.run_dir) / "profile" / f"actor_rank{self.rank}.json"
        window = ProfilerWindow(self.run.profiling.steps, trace)   # a torch profiler over steps a..b
        last: dict = {}
        with Progress(TextColumn(f"[bold]{self.name}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.description}"),
                      console=self.console, disable=self.rank != 0) as progress:
            task = progress.add_task("", total=tc.num_steps, completed=self.step)
            while self.step < tc.num_steps:
                if watchdog is not None:   # the phase a hang report names
                    watchdog.enter("step", self.step + 1)
                if stop is not None:
                    stop.step_begins()
                window.step_begins(self.step + 1)
                t0 = time.perf_counter()
                metrics = self.train_step(self.step)
                self.step += 1
                window.step_ends(self.step)
                record = {"step": self.step, **metrics, "step_time_s": time.perf_counter() - t0}
                if tc.eval_interval and self.step % tc.eval_interval == 0 and self.step < tc.num_steps:
                    record.update(self.evaluate())
                if self.step == tc.num_steps:
                    record.update(self.evaluate())
                self.metrics.log(record)
                progress.update(task, advance=1, description=" ".join(
                    f"{k}={v:.4g}" for k, v in record.items() if k not in ("step", "step_time_s")))
                saved = bool((tc.save_interval and self.step % tc.save_interval == 0) or self.step == tc.num_steps)
                if saved:
                    self.save()
                if watchdog is not None:   # a step (and its save) ended: progress
                    watchdog.progress("step", self.step)
                last = record
                # A stop commits its step before stopped_step is written: with async_save a write
                # of this step under way counts as not saved yet (save_and_wait joins it).
                if stop is not None and stop.after_step(self.step, last=self.step == tc.num_steps,
                                                        saved=saved and self.writer is None,
                                                        save=lambda _: self.save_and_wait()):
                    break
        window.close()
        if self.writer is not None:   # the last checkpoint is committed before the run ends
            self.writer.wait()
        if watchdog is not None:
            watchdog.stop()
        self.metrics.close()
        self._print(f"{self.name} done: " + " ".join(f"{k}={v:.4g}" for k, v in last.items()))
        return last
