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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async

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


def save_checkpoint(root: str | Path, step: int, chunks: list, optimizer, common: dict) -> Path:
    """Collective over all ranks. `common` (step, data position, ...) must be the same on every
    rank; torch's RNG state of rank 0 is added."""
    apply_cpu_compat()
    _results_queue_in_process()
    final = iter_dir(Path(root), step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
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
    dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": step, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    dist.barrier()
    return final


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
