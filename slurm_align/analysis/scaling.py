"""Scaling report over a sweep directory: step time, throughput and efficiency per node count.

Efficiency is relative to the smallest point (N = nodes / smallest nodes, T1 its step time):
weak scaling (batch grows with nodes) T1 / TN; strong scaling (fixed batch) T1 / (N * TN).
Samples and tokens per step come from the run's rollout store when it has one (tokens are the
model's generated response tokens, a multi-turn environment's excluded), else the samples from
the sweep manifest and no token rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console

from slurm_align.analysis.breakdown import Breakdown, compute_breakdown
from slurm_align.analysis.runs import load_run
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.sweep import Manifest
from slurm_align.store.rollouts import RolloutStore


def efficiencies(nodes: list[int], step_s: list[float], mode: str) -> list[float]:
    """Scaling efficiency of each point against the smallest one."""
    if mode not in ("weak", "strong"):
        raise ConfigError.at("mode", mode, "allowed: weak, strong")
    n0, t0 = nodes[0], step_s[0]
    out = []
    for n, t in zip(nodes, step_s):
        factor = n / n0
        out.append(t0 / t if mode == "weak" else t0 / (factor * t))
    return out


@dataclass
class ScalingPoint:
    nodes: int
    critic_nodes: int
    state: str
    run_dir: Path
    step_s: float = float("nan")
    samples_per_step: float = float("nan")
    tokens_per_step: float | None = None
    efficiency: float = float("nan")
    breakdown: Breakdown | None = None
    error: str | None = None
    predicted_step_s: float | None = None
    """The step time predicted from a calibration (planning/calibration.py predict_scaling)."""
    predicted_phase_s: dict[str, float] | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.tokens_per_step is None else self.tokens_per_step / self.step_s

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "critic_nodes": self.critic_nodes, "state": self.state,
                "run_dir": str(self.run_dir), "step_s": self.step_s, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s, "efficiency": self.efficiency, "error": self.error,
                "phase_s": (dict(zip(self.breakdown.phases, self.breakdown.mean_phase_s.tolist()))
                            if self.breakdown else None),
                "predicted_step_s": self.predicted_step_s, "predicted_phase_s": self.predicted_phase_s}


@dataclass
class ScalingReport:
    sweep_dir: Path
    mode: str
    points: list[ScalingPoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"sweep_dir": str(self.sweep_dir), "mode": self.mode, "points": [p.to_dict() for p in self.points]}


def _rollout_rates(run_dir: Path, steps: np.ndarray) -> tuple[float, float] | None:
    path = run_dir / "rollouts.zarr"
    if not (path / "zarr.json").is_file():
        return None
    store = RolloutStore.open(path, read_only=True)
    sizes = store.step_sizes()
    idx = np.flatnonzero(np.isin(sizes["step"], steps))
    if not len(idx):
        return None
    # Multi-turn trajectories hold the environment's tokens too (loss_mask 0): the rate is the
    # model's own generated tokens.
    tokens = [float(store.read(int(s))["loss_mask"].sum()) for s in sizes["step"][idx]]
    return float(sizes["num_samples"][idx].mean()), float(np.mean(tokens))


def compute_scaling(sweep_dir: str | Path, *, allow_incomplete: bool = False, skip_steps: int = 0,
                    console: Console | None = None) -> ScalingReport:
    manifest = Manifest.load(Path(sweep_dir))
    report = ScalingReport(Path(sweep_dir), manifest.mode)
    for pt in sorted(manifest.points, key=lambda p: p.nodes):
        run_dir = manifest.run_path(pt)
        sp = ScalingPoint(pt.nodes, pt.critic_nodes, pt.state, run_dir, samples_per_step=pt.rollout_samples,
                          error=pt.error)
        report.points.append(sp)
        if pt.state != "COMPLETED":
            continue
        try:
            run = load_run(run_dir, allow_incomplete=allow_incomplete, console=console)
        except ConfigError as e:
            sp.error = str(e)
            continue
        sp.breakdown = compute_breakdown(run.spans, name=f"{pt.nodes} nodes", skip_steps=skip_steps)
        sp.step_s = sp.breakdown.mean_step_s
        rates = _rollout_rates(run_dir, sp.breakdown.steps)
        if rates:
            sp.samples_per_step, sp.tokens_per_step = rates
    good = [p for p in report.points if p.breakdown is not None]
    if good:
        for p, eff in zip(good, efficiencies([p.nodes for p in good], [p.step_s for p in good], report.mode)):
            p.efficiency = eff
    return report
