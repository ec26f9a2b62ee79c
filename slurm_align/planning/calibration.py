"""Calibration: each phase's efficiency fitted from a finished run, to predict other layouts.

From RUN_DIR/traces.zarr: each phase's median time over the steps after warm-up, as the
breakdown reduces spans (a rank's summed spans, max over ranks; analysis/breakdown.py), taken
from the component that runs the phase (critic_infer and critic_train from the critic). From
RUN_DIR/rollouts.zarr: the prompt and response lengths of those steps (the response-length
distribution the prompt server balanced). Then, with the cost model of steptime.py on the run's
own config and profile:

    efficiency(phase) = ideal time(phase) / measured time(phase)

(measured less the phase's modelled collectives: TP's all-reduces, train's gradient all-reduce),
and each phase without a work model (store) keeps its measured time as a constant. Two more figures
come from the run: the share of rebalance before the log-prob passes (the first rebalance span of a
step against all of them) and `other`, the measured step less the step the fitted phases combine to
(time outside every span); both are kept as they are for other layouts. A prediction for another
layout or node count reuses these efficiencies and the length distribution (steptime.predict).
critic_wait is never fitted: it is what the combination derives from the critic's and the actor's
phases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_align.analysis.breakdown import Breakdown, compute_breakdown
from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import read_yaml, validate
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.planning.steptime import (
    CONSTANT_PHASES,
    MODELLED,
    Costs,
    StepPrediction,
    Workload,
    actor_share,
    ideal_phases,
    predict,
)
from slurm_align.rundir import RunDir

CRITIC_PHASES = ("critic_infer", "critic_train")
"""Phases read from the critic component's ranks (the others from the actor's, or any rank)."""


@dataclass
class Calibration:
    run_dir: Path
    run: RunConfig
    profile: ClusterProfile
    costs: Costs
    workload: Workload
    measured: dict[str, float]
    """Median seconds per phase over the steps analysed (critic_wait included, for comparison)."""
    measured_step_s: float
    """Median step time over those steps."""
    steps: list[int]
    dtype: str = "fp32"

    def predict(self, run: RunConfig | None = None, profile: ClusterProfile | None = None) -> StepPrediction:
        """Another layout (or this run's own) at the fitted efficiencies and length distribution."""
        return predict(run or self.run, profile or self.profile, costs=self.costs, work=self.workload, dtype=self.dtype)

    def notes(self, targets: Iterable[RunConfig]) -> list[str]:
        """What this calibration cannot see in the `targets` layouts it predicts, one line each.
        A component calibrated at one data-parallel rank and predicted at more: its ranks then
        wait for each other at the gradient collectives (and for the slowest of them), which no
        span of the calibration holds, so its training pass is under-predicted (measured on the
        local Slurm cluster, benchmarks/bench_plan.py: 4 ranks -26% to -53% from a 1-rank
        calibration, -19% to +13% from a 2-rank one)."""
        out = []
        targets = list(targets)
        for comp in ("actor", "critic"):
            if comp not in self.run.components or self.run.parallel(comp).data_parallel > 1:
                continue
            if comp == "critic" and not self.run.critic_trains:
                continue
            dp = max((t.parallel(comp).data_parallel for t in targets if comp in t.components), default=1)
            if dp > 1:
                phase = "train" if comp == "actor" else "critic_train"
                out.append(f"the calibration run has {comp}.data_parallel=1, a predicted layout "
                           f"{comp}.data_parallel={dp}: its ranks' waits for each other are not in the fit, so "
                           f"{phase} is likely under-predicted; calibrate on a run with {comp}.data_parallel >= 2")
        return out


def measured_phases(b: Breakdown, engine_component: str = "actor") -> tuple[dict[str, float], float]:
    """Median seconds per phase (from the component that runs it: generate from the engine's)
    and the median step time."""
    out: dict[str, float] = {}
    for j, phase in enumerate(b.phases):
        comp = "critic" if phase in CRITIC_PHASES else engine_component if phase == "generate" else "actor"
        table = b.component_phase_s.get(comp, b.phase_s)
        out[phase] = float(np.median(table[:, j]))
    return out, float(np.median(b.step_s))


def fit(run: RunConfig, profile: ClusterProfile, measured: dict[str, float], work: Workload,
        dtype: str = "fp32") -> Costs:
    """Efficiencies that make the cost model reproduce `measured` on the run's own layout."""
    ideal = ideal_phases(run, profile, work, dtype)
    costs = Costs()
    for phase in MODELLED:
        got = measured.get(phase, 0.0) - ideal.get(f"{phase}.link", 0.0)
        if ideal.get(phase, 0.0) > 0 and got > 0:
            costs.efficiency[phase] = ideal[phase] / got
    for phase in CONSTANT_PHASES:
        costs.constant_s[phase] = measured.get(phase, 0.0)
    costs.constant_share = actor_share(run, profile)
    return costs


def rebalance_share(spans: np.ndarray, steps: list[int]) -> float | None:
    """Share of the actor's rebalance time in the first rebalance span of each (step, rank)."""
    sel = spans[(spans["component"] == "actor") & (spans["phase"] == "rebalance") & np.isin(spans["step"], steps)]
    first = total = 0
    for key in {(int(s), int(r)) for s, r in zip(sel["step"], sel["rank"])}:
        mine = sel[(sel["step"] == key[0]) & (sel["rank"] == key[1])]
        mine = mine[np.argsort(mine["start_ns"])]
        d = mine["end_ns"] - mine["start_ns"]
        first, total = first + int(d[0]), total + int(d.sum())
    return first / total if total else None


def measured_workload(run_dir: Path, steps: list[int], samples: int) -> Workload:
    """Prompt and response lengths of `steps` from the run's rollout store."""
    from slurm_align.store.rollouts import RolloutStore  # zarr: see calibrate

    store = RolloutStore.open(RunDir(run_dir).rollouts, read_only=True)
    prompts: list[int] = []
    responses: list[int] = []
    for step in steps:
        got = store.read(step)
        prompts += np.diff(got["prompt_offsets"]).astype(int).tolist()
        responses += got["length"].astype(int).tolist()
    if not responses:
        raise ConfigError([f"no rollouts of steps {steps} in {RunDir(run_dir).rollouts}"], run_dir)
    return Workload(samples, tuple(prompts), tuple(responses))


def calibrate(run_dir: str | Path, *, profile: ClusterProfile | None = None, skip_steps: int = 1,
              work: Workload | None = None, dtype: str = "fp32") -> Calibration:
    """Fit a finished run (RUN_DIR with config.yaml, traces.zarr and rollouts.zarr). `profile`:
    the one it ran on (default RUN_DIR/profile.yaml, written at submit); `skip_steps`: warm-up
    steps left out; `work`: the step's lengths (default: read from its rollouts)."""
    # zarr is imported here, not with the module: every `slurm-align` call loads this module (plan)
    from slurm_align.analysis.runs import load_run

    rd = RunDir(Path(run_dir))
    traces = load_run(rd.root)
    run = traces.config
    if not isinstance(run, RunConfig):
        raise ConfigError(["config.yaml does not load; a calibration needs the run's config"], rd.config)
    if profile is None:
        if not rd.profile.is_file():
            raise ConfigError(["profile.yaml is missing (written by `slurm-align submit`): give the profile "
                               "the run ran on"], rd.root)
        profile = validate(ClusterProfile, read_yaml(rd.profile), rd.profile)
    b = compute_breakdown(traces.spans, name=rd.root.name, skip_steps=skip_steps)
    if not len(b.steps):
        raise ConfigError.at("skip_steps", skip_steps, f"leaves no step of the run's {skip_steps} or fewer", rd.root)
    measured, step_s = measured_phases(b, run.engine_component)
    steps = [int(s) for s in b.steps]
    work = work or measured_workload(rd.root, steps, run.rollouts_per_step)
    costs = fit(run, profile, measured, work, dtype)
    split = rebalance_share(traces.spans, steps)
    if split is not None:
        costs.rebalance_before_wait = split
    cal = Calibration(rd.root, run, profile, costs, work, measured, step_s, steps, dtype)
    costs.constant_s["other"] = max(0.0, step_s - cal.predict().step_s)
    return cal


def predict_scaling(report, cal: Calibration) -> None:
    """Each point of a scaling report (analysis/scaling.py) gets its predicted step and phases,
    from the config and profile its run was submitted with (points never launched get none)."""
    for point in report.points:
        rd = RunDir(point.run_dir)
        if not (rd.config.is_file() and rd.profile.is_file()):
            continue
        run = validate(RunConfig, read_yaml(rd.config), rd.config)
        profile = validate(ClusterProfile, read_yaml(rd.profile), rd.profile)
        got = cal.predict(run, profile)
        point.predicted_step_s, point.predicted_phase_s = got.step_s, got.phases
