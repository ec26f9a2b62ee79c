"""Tokens/s and MFU per step for the breakdown (`slurm-align analyze breakdown`).

  tokens_s  = the step's rollout tokens (prompt + response of every sample, rollouts.zarr)
  tokens/s  = tokens_s / T_s (T_s: the breakdown's step time)
  MFU_s     = model FLOPs_s / (T_s x sum over the run's ranks of their peak FLOP/s)

Model FLOPs come from the architecture through the step-time plan's cost model
(planning.steptime.step_model_flops: generation, log-prob passes, training, the critic's models),
never from kernel counters; the peak is the profile's (`hardware.peak_tflops`, else the
accelerator's default, planning/hardware.py) at the run's training precision, per rank, over every
rank of every component (a rank that waits is still a device the step holds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slurm_align.analysis.breakdown import Breakdown
from slurm_align.config.loading import read_yaml, validate
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.planning.calibration import measured_workload
from slurm_align.planning.hardware import profile_hardware
from slurm_align.planning.steptime import Workload, step_model_flops
from slurm_align.rundir import RunDir


def peak_flops(run: RunConfig, profile: ClusterProfile) -> float:
    """FLOP/s of every rank of the run together, at its training precision."""
    return sum(run.parallel(c).world_size * profile_hardware(profile, c).flops(run.training.precision)
               for c in run.components)


def add_throughput(b: Breakdown, run_dir: Path, run: RunConfig, profile: ClusterProfile | None) -> bool:
    """Fill `b`'s tokens and model FLOPs per step from the run's rollouts (and its peak from
    `profile`, when given). False, leaving `b` as it was, for a run without rollouts (SFT)."""
    if not (RunDir(run_dir).rollouts / "zarr.json").is_file():
        return False
    tokens, flops = [], []
    for step in b.steps:
        got = measured_workload(run_dir, [int(step)], run.rollouts_per_step)
        work = Workload(len(got.response_lengths), got.prompt_lengths, got.response_lengths)   # this step's own
        tokens.append(work.tokens)
        flops.append(sum(step_model_flops(run, work).values()))
    b.tokens, b.model_flops = np.array(tokens, dtype=float), np.array(flops)
    b.peak_flops = peak_flops(run, profile) if profile is not None else None
    return True


def run_profile(run_dir: Path) -> ClusterProfile | None:
    """The profile the run was submitted with (RUN_DIR/profile.yaml), if it is there."""
    path = RunDir(run_dir).profile
    return validate(ClusterProfile, read_yaml(path), path) if path.is_file() else None
