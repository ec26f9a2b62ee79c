"""What each rank of an sft / rm / dpo job runs: `main(run_dir)`."""

from __future__ import annotations

from pathlib import Path

import torch

from slurm_align.algorithms.trainer import Trainer
from slurm_align.config import load_run_config
from slurm_align.config.algorithms import REGISTRY
from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel
from slurm_align.rundir import RunDir
from slurm_align.slurm.preemption import StopPoint


def main(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    run = load_run_config(run_dir / "config.yaml")
    if run.spec.trainer is None:
        trainers = ", ".join(a.name for a in REGISTRY.values() if a.trainer)
        raise ValueError(f"train_main runs {trainers}; config says algorithm={run.algorithm!r}")
    torch.set_num_threads(1)
    env = init_distributed()
    rd = RunDir(run_dir)
    # preemption (Slurm's TERM, the script's USR2 warning): the ranks agree on a stop point after a
    # step, save, and the job script requeues the job, which resumes from that checkpoint
    stop = StopPoint(env.comm, rd, checkpoints=rd.checkpoints(run.algorithm))
    pctx = initialize_model_parallel(env, run.actor.tensor_parallel, run.actor.pipeline_parallel,
                                     run.actor.expert_parallel)
    try:
        return Trainer(run, pctx, run_dir).fit(stop)
    except BaseException:
        stop.exit_if_stopped_by_term()   # a peer's stop at Slurm's TERM broke a collective: not a failure
        raise
    finally:
        pctx.destroy()
