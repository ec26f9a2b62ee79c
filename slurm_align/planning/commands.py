"""`slurm-align plan`: before submitting, the memory each component's GPUs need (the memory plan,
config/memory_plan.py, against the profile's gpu_memory_gib) and, for the rollout algorithms, the
step time of the run's layout (or of a sweep's node counts), optionally calibrated on a finished
run, and the fastest layouts of a node budget that fit.

    slurm-align plan CONFIG --profile NAME [--nodes 1,2,4] [--calibration RUN_DIR] [--advise N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import check_against_profile, load_run_config, with_profile_defaults
from slurm_align.config.memory_plan import plan_run, render_plan
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.planning.advice import rank_layouts
from slurm_align.planning.calibration import Calibration, calibrate
from slurm_align.planning.steptime import DTYPE_BYTES, StepPrediction, predict
from slurm_align.slurm.choose import choose_profile
from slurm_align.slurm.sweep import SweepPoint, parse_nodes, plan_sweep


def _stdout() -> Console:
    """Tables to stdout; piped or captured output keeps whole rows instead of wrapping at 80."""
    return Console() if sys.stdout.isatty() else Console(width=220)

SHOWN = ("refit", "generate", "rebalance", "logprobs", "init_logprobs", "critic_infer", "critic_wait", "store", "save",
         "train", "critic_train", "weight_sync")


def predict_point(run: RunConfig, profile: ClusterProfile, cal: Calibration | None, dtype: str) -> StepPrediction:
    if cal is not None:
        return cal.predict(run, profile)
    return predict(run, profile, dtype=dtype)


def prediction_table(title: str, rows: list[tuple[str, StepPrediction]]) -> Table:
    t = Table(title=title)
    for col in ("point", "layout", "step s", "bound by", *(p for p in SHOWN if any(p in r.phases for _, r in rows))):
        t.add_column(col, justify="left" if col in ("point", "layout", "bound by") else "right")
    for label, r in rows:
        t.add_row(label, r.layout, f"{r.step_s:.3g}", r.bounding,
                  *(f"{r.phases[p]:.3g}" if p in r.phases else "-"
                    for p in SHOWN if any(p in x.phases for _, x in rows)))
    return t


def sweep_predictions(points: list[SweepPoint], cal: Calibration | None,
                      dtype: str = "fp32") -> list[tuple[str, StepPrediction]]:
    """The predicted step of each point `slurm-align sweep` would submit (slurm.sweep.plan_sweep)."""
    return [(f"{p.nodes} actor node(s)", predict_point(p.run, p.profile, cal, dtype)) for p in points]


def load_calibration(path: str | None, skip_steps: int, dtype: str) -> Calibration | None:
    return None if path is None else calibrate(Path(path), skip_steps=skip_steps, dtype=dtype)


def cmd_plan(args: argparse.Namespace) -> int:
    run = load_run_config(args.config, args.overrides)
    profile = choose_profile(args.profile, args.profile_set)
    run = with_profile_defaults(run, profile)
    if not args.nodes:   # a sweep's points get their own data_parallel (slurm.sweep.plan_point)
        check_against_profile(run, profile, source=args.config)
    memory = render_plan(plan_run(run), profile)
    if not run.spec.rollout:   # SFT/RM/DPO: no rollout step to predict
        if args.nodes or args.advise or args.calibration:
            raise ConfigError.at("--nodes/--advise/--calibration", None, f"algorithm {run.algorithm!r} has no "
                                 "rollout step: step-time prediction covers the rollout algorithms (ppo, grpo, ...)")
        print(json.dumps({"memory": memory}) if args.format == "json" else memory)
        return 0
    args.dtype = args.dtype or run.training.precision
    cal = load_calibration(args.calibration, args.skip_steps, args.dtype)
    source = f"calibrated on {cal.run_dir}" if cal else "default efficiencies"
    points = plan_sweep(run, profile, parse_nodes(args.nodes), args.mode) if args.nodes else []
    rows = ([("as configured", predict_point(run, profile, cal, args.dtype))] if not args.nodes
            else sweep_predictions(points, cal, args.dtype))
    advice = []
    if args.advise:
        advice = rank_layouts(run, profile, args.advise, costs=cal.costs if cal else None,
                              work=cal.workload if cal else None, dtype=args.dtype, top=args.top)
        if not advice:
            raise ConfigError.at("--advise", args.advise, "no layout of that many nodes fits in memory "
                                 "(profile gpu_memory_gib) with this model")
    notes = cal.notes([*([p.run for p in points] or [run]), *(o.run for o in advice)]) if cal else []
    if args.format == "json":
        print(json.dumps({"memory": memory, "source": source, "points": [{"point": k, **vars(v)} for k, v in rows],
                          "advice": [{"rank": i + 1, **vars(o.prediction), "state_bytes": o.state_bytes}
                                     for i, o in enumerate(advice)], "notes": notes}, indent=1))
        return 0
    out = _stdout()
    print(memory)
    out.print(prediction_table(f"predicted step time ({source})", rows))
    if advice:
        out.print(prediction_table(f"layouts of {args.advise} nodes that fit, fastest first",
                                   [(f"#{i + 1}", o.prediction) for i, o in enumerate(advice)]))
        best = advice[0].prediction
        out.print(f"best: {best.layout}; its step is bound by {best.bounding} "
                  f"({best.critical[best.bounding]:.3g} of {best.step_s:.3g} s)", highlight=False)
    for note in notes:
        out.print(f"note: {note}", highlight=False)
    return 0


def add_prediction_arguments(p: argparse.ArgumentParser) -> None:
    """--calibration, --skip-steps and --dtype: shared by predict, sweep --predict and analyze scaling."""
    p.add_argument("--calibration", default=None, metavar="RUN_DIR",
                   help="fit the phases' efficiencies and the response lengths on this finished run")
    p.add_argument("--calibration-skip-steps", dest="skip_steps", type=int, default=1,
                   help="warm-up steps of the calibration run left out (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="precision of weights and matmuls (default: the run's training.precision)")


def register(sub) -> None:
    from slurm_align.slurm.commands import add_run_arguments

    p = sub.add_parser("plan", help="before submitting: bytes per GPU of each component against the profile's "
                                    "gpu_memory_gib, the predicted step time per phase, and layout advice")
    add_run_arguments(p)
    p.add_argument("--nodes", default=None, help="actor node counts of a sweep to predict, e.g. 1,2,4")
    p.add_argument("--mode", choices=("weak", "strong"), default="weak", help="sweep scaling (with --nodes)")
    p.add_argument("--advise", type=int, default=None, metavar="NODES",
                   help="rank the layouts of this many nodes that fit in memory by predicted step time")
    p.add_argument("--top", type=int, default=5, help="layouts shown by --advise")
    p.add_argument("--format", choices=("table", "json"), default="table")
    add_prediction_arguments(p)
    p.set_defaults(func=cmd_plan)
