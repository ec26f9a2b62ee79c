"""Sharded checkpoints through megatron-core dist_checkpointing (torch_dist backend).

A checkpoint folder CHECKPOINTS/iter_<step> holds the model's sharded weights, the AdamW state
(per parameter and sharded like the parameters whatever the optimizer's own DP sharding, so
TP=2 loads with TP=1 and DP=2 with DP=1; bf16 runs add the fp32 main weights), and common
state: step, consumed samples, RNG state, the LR scheduler's state. A LoRA model's checkpoint
holds only its adapters (and their AdamW state) plus `lora_base`, the base it was trained on
(common["lora_base"], see trainers); the base weights come from there. It is written
atomically: every rank saves into iter_<step>.tmp, rank 0 writes manifest.json (every file's
size) last, renames the folder and fsyncs the parent. A folder without a manifest, or whose
files do not match it, is refused with a CheckpointError.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.utils import _DistWrapper, _get_failure_dict

from slurm_align.models.checkpoint_names import MANIFEST, find_latest, iter_dir  # noqa: F401  (their home is torch-free)
from slurm_align.models.cpu_compat import apply_cpu_compat
from slurm_align.models.lora import adapter_tensors, has_lora, sharded_adapter_state
from slurm_align.models.optimizer import ModelOptimizer
from slurm_align.rundir import fsync_dir


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated or does not fit the model."""


def _sharded_state(chunks: list, optimizer: Any, *, empty: bool = False) -> dict:
    """The model's (and optimizer's) sharded state dict. A ModelOptimizer (models/optimizer.py)
    gives its state per parameter, full tensors whatever its DP sharding (`empty`: zeros of
    those shapes, to load into), so a checkpoint loads at any TP/PP/DP layout; a plain torch
    optimizer gives its own state dict."""
    # LoRA: the adapters only (attached outside the module tree, see models/lora.py)
    model_sd = sharded_adapter_state(chunks) if has_lora(chunks) else chunks[0].sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        if isinstance(optimizer, ModelOptimizer):
            params = optimizer.params
            osd = optimizer.empty_per_param_state_dict() if empty else optimizer.per_param_state_dict()
        else:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            osd = optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
        state["optimizer"] = osd
    return state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW creates its state lazily; loading needs the tensors to exist."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}


def _optimizer_steps(optimizer: Any) -> int:
    """Updates the optimizer has made (AdamW keeps the count per parameter; they agree)."""
    if isinstance(optimizer, ModelOptimizer):
        return optimizer.steps
    for pstate in optimizer.state.values():
        if "step" in pstate:
            return int(pstate["step"])
    return 0


def _results_queue_in_process() -> None:
    """megatron's torch_dist writer hands its write results over a queue of a multiprocessing
    Manager it starts with `spawn` at a process's first save: a fresh Python that imports torch
    (measured: 2.5 CPU-s per rank, the dearest part of a short run's final save). Our saves are
    synchronous: the results are put and got in this process (the writer's forked children
    report through a queue of their own), so a plain queue.Queue serves. Set once, before the
    first save; a megatron without this module-level queue keeps its own."""
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def _prepare(root: str | Path, step: int, chunks: list, optimizer, common: dict) -> tuple[Path, Path, dict]:
    """(final folder, its .tmp, the state to save); the .tmp is fresh and empty on every rank."""
    apply_cpu_compat()
    _results_queue_in_process()
    final = iter_dir(Path(root), step)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died mid-save
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(chunks, optimizer)
    state["common"] = {**common, "step": step, "rng": torch.get_rng_state(), "lora": has_lora(chunks)}
    if optimizer is not None:   # AdamW's bias correction needs its own update count back
        state["common"]["optimizer_steps"] = _optimizer_steps(optimizer)
    if isinstance(optimizer, ModelOptimizer):   # the LR schedule continues where it was
        state["common"]["lr_scheduler"] = optimizer.scheduler.state_dict()
        if optimizer.scaler is not None:   # fp16: the loss scale and its trackers continue too
            state["common"]["grad_scaler"] = optimizer.scaler_state()
    return final, tmp, state


def _commit(tmp: Path, final: Path, step: int, barrier: Callable[[], None]) -> None:
    """Every rank's files are in `tmp`: rank 0 writes the manifest last, renames, fsyncs."""
    barrier()
    if dist.get_rank() == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": step, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    barrier()


def save_checkpoint(root: str | Path, step: int, chunks: list, optimizer, common: dict) -> Path:
    """Collective over all ranks. `common` (step, data position, ...) must be the same on every
    rank; torch's RNG state of rank 0 is added."""
    final, tmp, state = _prepare(root, step, chunks, optimizer, common)
    dist_checkpointing.save(state, str(tmp))
    _commit(tmp, final, step, dist.barrier)
    return final


class _KeepFinalizeArgs(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy (the one `dist_checkpointing.save` uses by default,
    so the files are the same), keeping what its finalisation needs: the writer and the global
    metadata, which AsyncCheckpointWriter finalises on a process group of its own."""

    finalize_args: tuple | None = None

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
        self.finalize_args = tuple(save_state_dict_ret)
        return super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)


class AsyncCheckpointWriter:
    """`checkpointing.async_save`: the step waits for the save's planning (collective) and a host
    copy of this rank's shards; a background thread writes them (megatron's writer, forked
    processes), finalises megatron's metadata and commits with the manifest last, as
    save_checkpoint does. Its collectives run on a gloo group of its own, created at the first
    save, so they never interleave with the step's on the default group. `wait()` joins it (and
    raises what it raised): before the next save, a stop for preemption and the end of the run.
    `on_commit` runs on rank 0 once the checkpoint is committed (retention)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint write failed: {error}") from error

    def save(self, root: str | Path, step: int, chunks: list, optimizer, common: dict,
             on_commit: Callable[[], object] | None = None) -> Path:
        """Collective over all ranks, like save_checkpoint; returns once the write is under way."""
        self.wait()
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        final, tmp, state = _prepare(root, step, chunks, optimizer, common)
        strategy = _KeepFinalizeArgs("torch_dist", 1)
        request = dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy, async_sharded_save=True)
        assert request is not None and strategy.finalize_args is not None   # async_sharded_save=True
        args = list(request.async_fn_args)
        if request.async_fn is not None:   # the host copy: the step may change the tensors from now on
            args[1] = [(name, key, (data, [(item, t.detach().to("cpu", copy=True)) for item, t in tensors]))
                       for name, key, (data, tensors) in args[1]]
        self._thread = threading.Thread(target=self._write, name=f"checkpoint-writer-{step}", daemon=True,
                                        args=(request, args, strategy.finalize_args, tmp, final, step, on_commit))
        self._thread.start()
        return final

    def _write(self, request, args, finalize_args, tmp: Path, final: Path, step: int, on_commit) -> None:
        try:
            if request.async_fn is not None:
                request.async_fn(*args, **request.async_fn_kwargs)
            barrier = partial(dist.barrier, group=self._group)
            barrier()
            self._finalize(*finalize_args)
            if dist.get_rank() == 0:   # dist_checkpointing.save's own last file (metadata.json)
                save_config(CheckpointingConfig("torch_dist", 1), str(tmp))
            _commit(tmp, final, step, barrier)
            if on_commit is not None and dist.get_rank() == 0:
                on_commit()
        except BaseException as e:  # handed to wait(), in the main thread
            self._error = e

    def _finalize(self, storage_writer, global_metadata, _default_group_wrapper) -> None:
        """megatron's save_state_dict_async_finalize on this writer's group (the metadata file)."""
        wrapper = _DistWrapper(self._group, True, 0)
        results = wrapper.gather_object(storage_writer.retrieve_write_results())
        failures = _get_failure_dict(results or []) if wrapper.is_coordinator else {}
        if wrapper.is_coordinator and not failures:
            storage_writer.finish(global_metadata, results)
        failed = torch.tensor([int(bool(failures))])
        dist.broadcast(failed, src=dist.get_global_rank(self._group, 0), group=self._group)
        if int(failed):
            raise CheckpointError(f"megatron's checkpoint writer failed: {failures or 'on rank 0'}")


def verify_checkpoint(path: str | Path) -> dict:
    """The manifest, after checking every file it lists is there with its recorded size."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish); "
                              "delete it or resume from an earlier iter_* folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is corrupt ({e})") from None
    for name, size in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: file {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path} is truncated or modified: {name} has "
                                  f"{f.stat().st_size} bytes, the manifest says {size}")
    return manifest


def load_checkpoint(path: str | Path, chunks: list, optimizer=None) -> dict:
    """Load weights (and optimizer state if given) into this rank's shards, whatever TP/PP the
    checkpoint was saved with. Collective. Returns the common state (step, rng, ...)."""
    apply_cpu_compat()
    path = Path(path)
    verify_checkpoint(path)
    saved_lora = bool(dist_checkpointing.load_common_state_dict(str(path)).get("common", {}).get("lora"))
    if saved_lora != has_lora(chunks):
        raise CheckpointError(
            f"checkpoint {path} holds {'LoRA adapters only' if saved_lora else 'full weights'}, but the model "
            f"{'has' if has_lora(chunks) else 'has no'} adapters: "
            + ("load its base first and set model.lora as in the run that saved it" if saved_lora
               else "a base checkpoint is loaded before model.lora attaches the adapters"))
    if optimizer is not None and not isinstance(optimizer, ModelOptimizer):
        init_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, empty=True)
    state["common"] = {}
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:  # torch_dist reports damage as assorted exception types
        raise CheckpointError(f"checkpoint {path} could not be loaded into this model "
                              f"({type(e).__name__}: {e})") from e
    if saved_lora:
        with torch.no_grad():
            for key, p in adapter_tensors(chunks):
                p.copy_(loaded["model"][key])
    else:
        chunks[0].load_state_dict(loaded["model"], strict=False)
    common = loaded["common"]
    if optimizer is not None:
        osd = loaded["optimizer"]
        steps = common.get("optimizer_steps", common["step"])   # older checkpoints: the step
        if isinstance(optimizer, ModelOptimizer):
            optimizer.load_per_param_state_dict(osd, steps)
            if "lr_scheduler" in common:
                optimizer.scheduler.load_state_dict(common["lr_scheduler"])
            if "grad_scaler" in common:
                optimizer.load_scaler_state(common["grad_scaler"])
        else:
            for pstate in osd["state"].values():
                pstate["step"] = torch.tensor(float(steps))
            optimizer.load_state_dict(osd)
    return common


def load_weights(path: str | Path, chunks: list) -> dict:
    """Model weights only (an init_checkpoint: SFT result for the policy, RM for the critic)."""
    return load_checkpoint(path, chunks, optimizer=None)
