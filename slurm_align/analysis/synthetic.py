"""A synthetic PPO-shaped workload that writes real spans and rollouts through the stores.

It runs as the ranks of a real job (launchers/trace_demo.py, through `--entry trace_demo`), so
sweeps, the breakdown and the scaling report can be exercised end to end before (or without)
the real PPO loop. Each phase sleeps a time proportional to the samples its rank handles, so
weak scaling holds the step time and strong scaling shrinks it: the analysis must show that.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from slurm_align.profiling import phases as P
from slurm_align.profiling.timers import Tracer
from slurm_align.store.rollouts import TOKEN_FIELDS, RolloutStore

MS = 1e-3
# Seconds per sample a rank handles, per phase (fixed costs per step below).
ACTOR_PER_SAMPLE = {P.GENERATE: 4 * MS, P.LOGPROBS: 1 * MS, P.INIT_LOGPROBS: 1 * MS, P.TRAIN: 3 * MS}
CRITIC_PER_SAMPLE = {P.CRITIC_INFER: 1 * MS, P.CRITIC_TRAIN: 2 * MS}
ACTOR_FIXED = {P.REFIT: 5 * MS, P.CRITIC_WAIT: 2 * MS, P.REBALANCE: 1 * MS}


def _rollouts(step: int, n: int, rank_of: np.ndarray, seed: int) -> dict:
    rng = np.random.default_rng(seed + step)
    lengths = rng.integers(4, 17, n)
    return {
        "prompt_tokens": [rng.integers(0, 256, 8) for _ in range(n)],
        "response_tokens": [rng.integers(0, 256, k) for k in lengths],
        **{f: [rng.standard_normal(k).astype(np.float32) for k in lengths] for f in TOKEN_FIELDS},
        "reward": rng.standard_normal(n).astype(np.float32), "is_end": lengths < 16, "rank": rank_of,
    }


def run(run_dir: Path, component: str, comm) -> None:
    from slurm_align.config import load_run_config
    cfg = load_run_config(run_dir / "config.yaml")
    rank, world = comm.Get_rank(), comm.Get_size()
    batch = cfg.ppo.num_rollout_samples
    mine = math.ceil(batch / world)
    store = RolloutStore.create(run_dir / "rollouts.zarr") if component == "actor" and rank == 0 else None
    with Tracer(run_dir, component, rank) as tracer:
        for step in range(cfg.ppo.num_steps):
            if component == "actor":
                for phase in (P.REFIT, P.GENERATE, P.LOGPROBS, P.INIT_LOGPROBS, P.CRITIC_WAIT, P.REBALANCE):
                    with tracer.span(phase, step):
                        time.sleep(ACTOR_FIXED.get(phase, 0) + ACTOR_PER_SAMPLE.get(phase, 0) * mine)
                if store is not None:
                    with tracer.span(P.STORE, step):
                        store.append_step(step, _rollouts(step, batch, np.arange(batch) % world, cfg.seed))
                with tracer.span(P.TRAIN, step):
                    time.sleep(ACTOR_PER_SAMPLE[P.TRAIN] * mine)
            else:
                for phase, cost in CRITIC_PER_SAMPLE.items():
                    with tracer.span(phase, step):
                        time.sleep(cost * mine)
            comm.Barrier()  # a step ends together on every rank: the wait shows as idle
            tracer.step_done(step)
