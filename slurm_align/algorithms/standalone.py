"""The actor component run alone over a data set (`slurm-align eval`, `slurm-align generate`):
every rank loads the model (model.init_checkpoint, or model.hf_path), builds its generation
engine (any of generation.make_engine's: torch, vllm, trtllm, ...) and refits it once. The
jobs differ only in what they do with it (algorithms/eval_main.py, algorithms/generate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slurm_align.algorithms.ppo import actor_engine
from slurm_align.config import RunConfig
from slurm_align.generation.base import Engine
from slurm_align.generation.refit import refit_from_training
from slurm_align.models.checkpoint import find_latest, load_weights
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import attach_configured
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.parallel.layout import ParallelContext, initialize_model_parallel


@dataclass
class StandaloneActor:
    pctx: ParallelContext
    tokenizer: Any
    policy: list                 # the megatron model chunks (training layout)
    engine: Engine               # refitted from `policy`
    checkpoint: Path | None      # the resolved iter_* folder; None for model.hf_path


def checkpoint_step(path: Path | None) -> int:
    """The step of an iter_<N> checkpoint folder; 0 for anything else (an HF folder)."""
    m = re.match(r"^iter_(\d+)$", path.name) if path is not None else None
    return int(m.group(1)) if m else 0


def load_standalone_actor(run: RunConfig, env) -> StandaloneActor:
    """Collective over the component: the model, its engine, refitted once."""
    pctx = initialize_model_parallel(env, run.actor.tensor_parallel, run.actor.pipeline_parallel,
                                     run.actor.expert_parallel)
    torch.manual_seed(run.seed)
    tokenizer = build_tokenizer(run.model)
    policy = build_gpt(run.model, pctx, seed=run.seed)   # model.hf_path: the HF weights
    checkpoint = None
    if run.model.init_checkpoint is not None:
        checkpoint = find_latest(run.model.init_checkpoint) or run.model.init_checkpoint
        load_weights(checkpoint, policy)
    attach_configured(policy, run.model, pctx, run.seed)
    engine = actor_engine(run, env, pctx)
    refit_from_training(engine, policy, pctx, refold=run.switches.refold)
    return StandaloneActor(pctx, tokenizer, policy, engine, checkpoint)
