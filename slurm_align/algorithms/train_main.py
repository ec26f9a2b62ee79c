"""What each rank of an sft / rm / dpo job runs: `main(run_dir)`."""

from __future__ import annotations

from pathlib import Path

import torch

from slurm_align.algorithms.trainer import Trainer
from slurm_align.config import load_run_config
from slurm_align.config.algorithms import REGISTRY
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel


def main(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    run = load_run_config(run_dir / "config.yaml")
    if run.spec.trainer is None:
        trainers = ", ".join(a.name for a in REGISTRY.values() if a.trainer)
        raise ValueError(f"train_main runs {trainers}; config says algorithm={run.algorithm!r}")
    torch.set_num_threads(1)
    env = init_distributed()
    pctx = initialize_model_parallel(env, run.actor.tensor_parallel, run.actor.pipeline_parallel,
                                     run.actor.expert_parallel)
    try:
        return Trainer(run, pctx, run_dir).fit()
    finally:
        pctx.destroy()
