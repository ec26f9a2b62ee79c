"""The step-time plan against measurement: calibrate on the 1-node point of a weak-scaling sweep on
the local Slurm cluster, predict the 2- and 4-node points, and compare with their measured step
time (median of the steps after the first), for PPO and for GRPO.

Starts its own local Slurm cluster (tests/cluster, 6 nodes: PPO's 4 actor nodes and its critic);
every point is a real job (one at a time). The local cluster's nodes are slurmd processes on this
one host, so the ranks of a point share its cores: the local-slurm profile says so
(hardware.shared_host) and the model counts it. Per point and phase it prints predicted and
measured; last line `plan_time_error_max= plan_phase_error_max= plan_mem_error_max=` (relative
errors over the predicted points; the phase error over the phases above 5% of the step; the memory
plan is not part of this branch: n/a). Goals: <= 0.15, <= 0.25, <= 0.15.

    PYTHONPATH=$PWD python benchmarks/bench_plan.py [--steps 5] [--rounds 1] [--algorithms ppo,grpo] [--out DIR]
    PYTHONPATH=$PWD python benchmarks/bench_plan.py --from DIR   # compare an earlier run's sweeps again

Side by side, the same sweeps calibrated on their 2-node point predict the 4-node one (the line
before the last): a calibration that has data-parallel ranks in it.

Measured on this project's 2-core machine shared with other sessions (tiny models, 16-32
rollouts per step at 1 node), step time predicted vs measured at 2 / 4 actor nodes:
  2026-12-04, --steps 4: PPO +68% / +19% (its 1-node calibration point was slower than the 2-node
             point: noise), GRPO -0% / +2%; plan_time_error_max=0.682 plan_phase_error_max=4.707
             (10^7-step loop 0.95 s)
  2026-12-04, --steps 8, PPO only: +4% / -59%; plan_time_error_max=0.591 plan_phase_error_max=0.883
             (loop 0.65 s)
  2026-12-06, --steps 6 (load average 26-83 during the sweeps, loop 2-6.6 s against 0.2-0.3 s
             idle), the same runs predicted by both models:
             the model counting only a component's own ranks on the shared cores: PPO -47% / -38%,
             GRPO -44% / -61%; plan_time_error_max=0.606 plan_phase_error_max=0.892
             every rank of the job counted (critic included) and the constant phases moved with
             the actor's share: PPO -22% / -6% (critic_infer +5% / +4%, was -30% / -58%), GRPO
             -44% / -44%; plan_time_error_max=0.445 plan_phase_error_max=0.892 (GRPO's generate
             at 4 nodes, -89%)
  2026-12-06, --steps 6 again, with this file's load lines (load average 24 -> 39 over PPO's
             sweep, 39 -> 21 over GRPO's; loop 0.33 s after): own ranks only: PPO -39% / -41%,
             GRPO +17% / -73%, plan_time_error_max=0.730 plan_phase_error_max=3.699; every rank
             counted: PPO -12% / +4%, GRPO +17% / -69%, plan_time_error_max=0.694
             plan_phase_error_max=3.699 (GRPO's log-probs at 2 nodes, +370%: its 1-node
             calibration measured them 4.7x slower than the 2-node run at the same work per rank).
             PPO's phases alone: max error 0.742 -> 0.663 in the first pair, 0.929 -> 1.576 in this
             one (the critic's passes, which here slowed by less than their work grew, while the
             first pair's slowed by the core share: +5% / +4% predicted there, +84% / +158% here)
  2026-12-07, --steps 5 on an idle host (load average 0.2 before PPO's sweep, 8.6 after it, 31.8
             after GRPO's; loop 0.12 s), after the prompt server stopped busy-polling: PPO +0% /
             +1% / -71%, GRPO +0% / -11% / -88% at 1 (calibration) / 2 / 4 nodes;
             plan_time_error_max=0.876 plan_phase_error_max=2.028. The 2-node points within 15%
             for both; the 4-node points far under (PPO's rebalance, GRPO's log-probs 8.5x slower
             than predicted) with the job's own ranks well over the 2 cores.
  2026-12-07, --steps 5, idle host (loop 0.12 s), after every wait where ranks arrive at
             different times stopped busy-polling in MPI (slurm_align/parallel/quiet.py: the
             prompt server's start and a worker's wait for its prompts, the rebalances, the
             preemption vote...): PPO +0% / -2% / +13%, GRPO +0% / +2% / -20%;
             plan_time_error_max=0.202 plan_phase_error_max=3.065 (the critic's passes at 4 nodes,
             predicted from the core share, measured faster). Before, the ranks that arrived first
             spun inside MPI and took the cores the slow rank needed: GRPO's 4-node step measured
             0.63-0.93 s (ranks' CPU 6-14 CPU-s for the same per-rank work as 2 nodes' 4.3), now
             0.16-0.19 s (5.5 CPU-s a rank). Four more runs of the same code the same hour (idle
             host, loop 0.12 s): PPO -1% / -6%, -6% / -23%, -8% / -26%, -9% / -15%(*); GRPO -14% /
             -42%, -10% / -61%, -11% / -5%, -3% / -83%(*) at 2 / 4 nodes; plan_time_error_max
             0.420, 0.613, 0.261, 0.833(*) ((*) with a 1 ms hot poll before each sleep: not kept).
             The 4-node points move by tens of percent between runs of one build: the goal is
             not met reliably.
  2026-12-07, --steps 5, idle host (load average 1.8-6.2, loop 0.12 s), three runs of one build,
             each predicted by both critic models from its own sweep (PPO 2 / 4 nodes; GRPO has no
             critic: +7% / -29%, +7% / +12%, -24% / -46%):
             the critic's passes at the job's cores: PPO +5% / +42%, +37% / +32%, +4% / -26%;
             plan_time_error_max 0.423, 0.373, 0.460; plan_phase_error_max 3.413, 3.987, 1.068
             (the critic's passes, +58%..+227% and +107%..+399%);
             at the critic's own cores (steptime.critic_share, kept): PPO -5% / -16%, +23% / -23%,
             -4% / -55%; plan_time_error_max 0.288, 0.228, 0.550; plan_phase_error_max 1.159,
             1.051, 0.648 (the critic's passes -31%..+67% and +38%..+99%). The 4-node points'
             measured steps varied by up to 1.9x between the runs (PPO 0.43 / 0.61 / 0.81 s, GRPO
             0.30 / 0.17 / 0.30 s): no prediction is within 15% of all of them.
  2026-12-07, --steps 5 --rounds 3 (the sweeps interleaved PPO, GRPO, PPO...; idle host, load
             average 0.7-4.7, loop 0.18 s after): medians over the rounds, predicted vs measured,
             PPO +6% / -9%, GRPO -25% / -48% at 2 / 4 nodes; plan_time_error_max=0.479
             plan_phase_error_max=1.050. One build's measured step at one point, between the three
             rounds (minutes apart): PPO 1 node 0.139-0.189 s (x1.36), 2 nodes 0.236-0.415 (x1.76),
             4 nodes 0.573-0.691 (x1.21); GRPO 0.053-0.062 (x1.17), 0.083-0.108 (x1.30), 0.194-0.662
             (x3.42). The host's own spread is above the 15% goal at every point. Systematic: train is
             under-predicted at every 2- and 4-node point of every round (-26%..-58%): the
             data-parallel ranks' waits for each other (the gradient collectives, a straggler),
             which a 1-node calibration (DP 1) has none of to fit; rebalance is not (GRPO
             -63%..+92%, PPO -68%..+34%).
             The same sweeps calibrated on their 2-node point (--from): the 4-node points' train
             -19%..+13%, step medians PPO -14%, GRPO -35% (its 3.4x spread); the line before the last
             `4-node points calibrated on the 2-node point instead: plan_time_error_max=0.352`.
             The same sweeps again (--from) after the collectives' latency joined the model
             (steptime.collective_s; this CPU's 1.8 ms a gloo all-reduce): PPO +6% / -9%, GRPO
             -20% / -46% (was -25% / -48%); plan_time_error_max=0.462; from the 2-node point 0.369.
The goals are not all met here: the 4-node GRPO point and the phase errors; per-call overheads
(Python, HTTP) dominate these tiny models, and other sessions' load (2-4x between steps) is not
known before submitting.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_align import REPO_ROOT
from slurm_align.planning.calibration import Calibration, calibrate
from slurm_align.slurm.sweep import Manifest
from tests.cluster import LocalSlurmCluster

NODES = "1,2,4"
SETTINGS = {
    "ppo": [str(REPO_ROOT / "examples" / "ppo_tiny.yaml"), 'sweep.actor_to_critic_nodes="4:1"',
            "ppo.num_rollout_samples=8", "generation.max_new_tokens=16", "generation.prompt_batch_size=2",
            "ppo.train_micro_batch_size=4"],
    "grpo": [str(REPO_ROOT / "examples" / "grpo_tiny.yaml"), "ppo.num_rollout_samples=4", "rl.n_samples_per_prompt=4",
             "ppo.global_batch_size=16", "generation.max_new_tokens=12", "eval.interval=0",
             "ppo.train_micro_batch_size=8"],
}


def run_sweep(algorithm: str, steps: int, out: Path) -> Path:
    config, *overrides = SETTINGS[algorithm]
    sweep = out / algorithm
    cmd = [sys.executable, "-m", "slurm_align.cli", "sweep", config, *overrides, f"ppo.num_steps={steps}",
           "--profile", "local-slurm", "--nodes", NODES, "--mode", "weak", "--sweep-dir", str(sweep),
           "--max-concurrent", "1", "--poll-s", "0.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{algorithm} sweep failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sweep


@dataclass
class Point:
    """One sweep point of one round: the step and its phases, predicted (from a calibration on
    one of the round's points) and measured (median of the steps after the first)."""

    nodes: int
    calibration: bool
    """This point is the one the prediction was calibrated on."""
    predicted_s: float
    measured_s: float
    predicted: dict[str, float]
    measured: dict[str, float]


def calibrations(sweep: Path) -> list[tuple[int, Calibration]]:
    """Each point of `sweep` (by actor nodes) fitted on its own run: its config, profile and
    measured phases and step (median of the steps after the first), and the calibration that
    predicts the other points when it is the one calibrated on. Each run is read once."""
    manifest = Manifest.load(sweep)
    return [(pt.nodes, calibrate(manifest.run_path(pt), skip_steps=1))
            for pt in sorted(manifest.points, key=lambda p: p.nodes)]


def compare(algorithm: str, points: list[tuple[int, Calibration]], cal_nodes: int = 1,
            verbose: bool = True) -> list[Point]:
    """Every point predicted from the calibration on the `cal_nodes` point; with `verbose`, per
    point and phase, predicted beside measured."""
    cal = dict(points)[cal_nodes]
    out = []
    for nodes, own in points:
        pred = cal.predict(own.run, own.profile)
        measured, step_s = own.measured, own.measured_step_s
        out.append(Point(nodes, own is cal, pred.step_s, step_s, dict(pred.phases), measured))
        if not verbose:
            continue
        label = "calibration" if own is cal else "predicted"
        print(f"{algorithm} {nodes} actor node(s) [{label}]: step predicted {pred.step_s:.3f} s, measured "
              f"{step_s:.3f} s ({pred.step_s / step_s - 1:+.0%}); bound by {pred.bounding}")
        for phase, t in sorted(pred.phases.items()):
            got = measured.get(phase, float("nan"))
            perr = t / got - 1 if got > 0 else float("nan")
            print(f"    {phase:14s} predicted {t:8.4f}  measured {got:8.4f}  ({perr:+.0%})")
    return out


def errors(algorithm: str, rounds: list[list[Point]], label: str = "") -> tuple[list[float], list[float]]:
    """The predicted points' errors, each point's prediction and measurement (step and phases) the
    median over the rounds; with several rounds, each point's measured steps and their spread
    (slowest / fastest round) are printed too: what the host itself varies between runs of one
    build, against which a prediction's error can be read."""
    time_errors, phase_errors = [], []
    for i, nodes in enumerate(p.nodes for p in rounds[0]):
        pts = [r[i] for r in rounds]
        pred, meas = float(np.median([p.predicted_s for p in pts])), float(np.median([p.measured_s for p in pts]))
        steps = [p.measured_s for p in pts]
        spread = f"; measured per round {', '.join(f'{s:.3f}' for s in steps)} (spread x{max(steps) / min(steps):.2f})"
        print(f"{algorithm}{label} {nodes} actor node(s), median of {len(pts)} round(s): predicted {pred:.3f} s, "
              f"measured {meas:.3f} s ({pred / meas - 1:+.0%})" + (spread if len(pts) > 1 else ""))
        if pts[0].calibration:
            continue
        time_errors.append(abs(pred / meas - 1))
        for phase in pts[0].predicted:
            got = float(np.median([p.measured.get(phase, np.nan) for p in pts]))
            if got > 0.05 * meas:
                phase_errors.append(abs(float(np.median([p.predicted[phase] for p in pts])) / got - 1))
    return time_errors, phase_errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--algorithms", default="ppo,grpo")
    ap.add_argument("--rounds", type=int, default=1,
                    help="sweeps per algorithm, interleaved (ppo, grpo, ppo, grpo...): each point's prediction "
                         "and measurement are medians over the rounds, and the measured spread is printed")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from", dest="reuse", type=Path, default=None,
                    help="compare the sweeps an earlier run left in this --out folder (runs nothing)")
    args = ap.parse_args()
    algorithms = args.algorithms.split(",")
    sweeps: dict[str, list[Path]] = {a: [] for a in algorithms}
    if args.reuse:
        out = args.reuse
        rounds = sorted(out.glob("round*")) or [out]
        for a in algorithms:
            sweeps[a] = [r / a for r in rounds]
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="bench-plan-"))
        cluster = LocalSlurmCluster(Path(tempfile.mkdtemp(prefix="sa-cluster-", dir="/tmp")), n_nodes=6,
                                    cpus_per_node=2)
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf_path)
        try:
            for r in range(args.rounds):
                for algorithm in algorithms:
                    # the host is shared: its load beside each sweep's figures (1-minute load average)
                    before = os.getloadavg()[0]
                    sweeps[algorithm].append(run_sweep(algorithm, args.steps,
                                                       out / f"round{r}" if args.rounds > 1 else out))
                    print(f"{algorithm} sweep (round {r + 1} of {args.rounds}): load average {before:.1f} before, "
                          f"{os.getloadavg()[0]:.1f} after")
        finally:
            cluster.stop()
    times: list[float] = []
    phases: list[float] = []
    from_two: list[float] = []
    for algorithm in algorithms:
        fitted = [calibrations(sweep) for sweep in sweeps[algorithm]]
        rounds = [compare(algorithm, points) for points in fitted]
        t, p = errors(algorithm, rounds)
        times += t
        phases += p
        # Side by side: the same sweeps calibrated on the 2-node point (data parallel 2, as the
        # 4-node point), predicting the 4-node one: what a calibration with the target's
        # data-parallel waits in it gives (docs/training.md).
        two = [compare(algorithm, points, cal_nodes=2, verbose=False) for points in fitted]
        from_two += errors(algorithm, [[p for p in r if p.nodes != 1] for r in two], " [calibrated on 2 nodes]")[0]
    loop = _loop_s()
    print(f"runs under {out}; 10^7-step Python loop {loop:.2f} s")
    print(f"4-node points calibrated on the 2-node point instead: plan_time_error_max={max(from_two):.3f}")
    print(f"plan_time_error_max={max(times):.3f} plan_phase_error_max={np.nanmax(phases):.3f} plan_mem_error_max=n/a")
    return 0


def _loop_s() -> float:
    import time

    t0 = time.perf_counter()
    for _ in range(10**7):
        pass
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
