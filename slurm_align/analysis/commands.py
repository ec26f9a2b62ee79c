"""`slurm-align analyze breakdown|trace|scaling|settings` and `slurm-align sweep`."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from slurm_align.analysis.breakdown import Breakdown, compute_breakdown
from slurm_align.analysis.trace_export import write_chrome_trace
from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import with_profile_defaults
from slurm_align.planning.commands import add_prediction_arguments
from slurm_align.profiling.phases import phase_order
from slurm_align.rundir import new_run_dir
from slurm_align.slurm.choose import choose_profile, default_run_root
from slurm_align.slurm.render import Entry
from slurm_align.slurm.sweep import parse_nodes, parse_set, plan_sweep, start_sweep

console = Console(stderr=True)


def _stdout() -> Console:
    """Tables to stdout; piped or captured output keeps whole rows instead of wrapping at 80."""
    return Console() if sys.stdout.isatty() else Console(width=200)


def _breakdown_table(b: Breakdown) -> Table:
    """Summary over the steps, one row per phase: fits a 100-column terminal whatever the steps."""
    t = Table(title=f"{b.name}: {b.mean_step_s:.3f} s per step ({len(b.steps)} steps)",
              caption="seconds, max over ranks")
    t.add_column("phase", no_wrap=True)
    for col in ("mean s", "p50 s", "max s", "share"):
        t.add_column(col, justify="right", no_wrap=True)
    p50, top = b.percentile_phase_s(50), b.phase_s.max(axis=0)
    for j, p in enumerate(b.phases):
        t.add_row(p, f"{b.mean_phase_s[j]:.3f}", f"{p50[j]:.3f}", f"{top[j]:.3f}", f"{100 * b.share[j]:.1f}%")
    t.add_row("[bold]step", f"[bold]{b.mean_step_s:.3f}", f"{np.median(b.step_s):.3f}", f"{b.step_s.max():.3f}",
              "100%")
    if b.tokens_per_s is not None:   # analysis/throughput.py
        v = b.tokens_per_s
        t.add_row("tokens/s", f"{v.mean():.1f}", f"{np.median(v):.1f}", f"{v.max():.1f}", "")
    if b.mfu is not None:
        v = 100 * b.mfu
        t.add_row("MFU", f"{v.mean():.2f}%", f"{np.median(v):.2f}%", f"{v.max():.2f}%", "")
    return t


def _per_step_tables(b: Breakdown, width: int) -> list[Table]:
    """Every step as a column (--per-step), in as many tables as the console's width needs."""
    name_w = max(len(p) for p in [*b.phases, "phase"]) + 3
    per_table = max(1, (width - name_w - 1) // (len(f"step {int(b.steps[-1])}") + 3))
    tables = []
    for lo in range(0, len(b.steps), per_table):
        cols = slice(lo, lo + per_table)
        t = Table(title=f"{b.name}: seconds per step (max over ranks)" if lo == 0 else None)
        t.add_column("phase", no_wrap=True)
        for s in b.steps[cols]:
            t.add_column(f"step {s}", justify="right", no_wrap=True)
        for j, p in enumerate(b.phases):
            t.add_row(p, *[f"{v:.3f}" for v in b.phase_s[cols, j]])
        t.add_row("[bold]step", *[f"{v:.3f}" for v in b.step_s[cols]])
        tables.append(t)
    return tables


def _idle_table(b: Breakdown) -> Table:
    t = Table(title=f"{b.name}: idle per rank (step time - busy)")
    t.add_column("rank")
    t.add_column("mean idle s", justify="right")
    t.add_column("share", justify="right")
    for k, v in b.idle_s.items():
        t.add_row(k, f"{v.mean():.3f}", f"{100 * v.mean() / b.mean_step_s:.1f}%")
    return t


def _compare_table(bs: list[Breakdown]) -> Table:
    phases = phase_order({p for b in bs for p in b.phases})
    t = Table(title="mean seconds per step (max over ranks); share of step in brackets")
    t.add_column("phase")
    for b in bs:
        t.add_column(b.name, justify="right")
    for p in phases:
        cells = []
        for b in bs:
            if p in b.phases:
                j = b.phases.index(p)
                cells.append(f"{b.mean_phase_s[j]:.3f} ({100 * b.share[j]:.0f}%)")
            else:
                cells.append("-")
        t.add_row(p, *cells)
    t.add_row("[bold]step", *[f"[bold]{b.mean_step_s:.3f}" for b in bs])
    if len(bs) > 1:
        t.add_row("vs first", *[f"{b.mean_step_s / bs[0].mean_step_s:.2f}x" for b in bs])
    return t


def _csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


# matplotlib (plots) and zarr (runs -> store.traces) are imported in the commands that use them:
# every `slurm-align` call (each job's steps, each test's CLI run) would pay ~0.4 s of imports.
def cmd_breakdown(args) -> int:
    from slurm_align.analysis.plots import plot_breakdown, plot_timeline
    from slurm_align.analysis.runs import load_run
    from slurm_align.analysis.throughput import add_throughput, run_profile
    from slurm_align.config.run import RunConfig

    dirs = [Path(args.run_dir), *[Path(p) for p in (args.compare or [])]]
    runs = [load_run(d, allow_incomplete=args.allow_incomplete, console=console) for d in dirs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):  # same folder names under different parents
        names = [str(r.run_dir) for r in runs]
    bs = [compute_breakdown(r.spans, name=n, skip_steps=args.skip_steps) for r, n in zip(runs, names)]
    for r, b in zip(runs, bs):   # tokens/s and MFU where the run has rollouts and its config loads
        if isinstance(r.config, RunConfig) and len(b.steps):
            add_throughput(b, r.run_dir, r.config, run_profile(r.run_dir))
    if any(not len(b.steps) for b in bs):
        raise ConfigError.at("--skip-steps", args.skip_steps, "leaves no step to analyse")
    step = int(bs[0].steps[-1]) if args.timeline_step is None else args.timeline_step
    if step not in bs[0].steps:
        raise ConfigError.at("--timeline-step", step, f"not an analysed step "
                             f"({int(bs[0].steps[0])}..{int(bs[0].steps[-1])})")
    if args.format == "json":
        print(json.dumps([b.to_dict() for b in bs] if len(bs) > 1 else bs[0].to_dict(), indent=1))
    elif args.format == "csv":
        rows = [{"run": b.name, "step": int(s), "phase": p, "seconds": float(b.phase_s[i, j]),
                 "step_seconds": float(b.step_s[i])}
                for b in bs for i, s in enumerate(b.steps) for j, p in enumerate(b.phases)]
        sys.stdout.write(_csv(rows))
    else:
        out = _stdout()
        if len(bs) == 1:
            out.print(_breakdown_table(bs[0]))
            if args.per_step:
                for table in _per_step_tables(bs[0], out.width):
                    out.print(table)
            out.print(_idle_table(bs[0]))
        else:
            out.print(_compare_table(bs))
    png = Path(args.png) if args.png else runs[0].run_dir / "reports" / (
        "breakdown.png" if len(bs) == 1 else "compare.png")
    if not args.no_plot:
        plot_breakdown(bs, png)
        console.print(f"chart: {png}", highlight=False)
        if len(bs) == 1:
            timeline = png.with_name(f"timeline_step{step}.png")
            plot_timeline(runs[0].spans, step, timeline, f"{bs[0].name}, step {step}: spans per component and rank")
            console.print(f"timeline: {timeline}", highlight=False)
    return 0


def cmd_trace(args) -> int:
    from slurm_align.analysis.runs import load_run

    run = load_run(args.run_dir, allow_incomplete=args.allow_incomplete, console=console)
    spans = run.spans if args.allow_incomplete else run.table.spans
    n = write_chrome_trace(spans, Path(args.output), run.name)
    console.print(f"wrote {n} spans to {args.output} (open in https://ui.perfetto.dev)", highlight=False)
    return 0


def _scaling_table(report) -> Table:
    t = Table(title=f"{report.mode} scaling: {report.sweep_dir}")
    predicted = any(p.predicted_step_s is not None for p in report.points)
    for col in ("actor nodes", "critic nodes", "state", "step s", *(("predicted s", "error") if predicted else ()),
                "samples/s", "tokens/s", "efficiency", "phase split (mean s)"):
        t.add_column(col, justify="right" if col not in ("state", "phase split (mean s)") else "left")
    for p in report.points:
        pred: tuple[str, ...] = ()
        if predicted:
            err = "-" if p.predicted_step_s is None or p.breakdown is None else \
                f"{100 * (p.predicted_step_s / p.step_s - 1):+.0f}%"
            pred = ("-" if p.predicted_step_s is None else f"{p.predicted_step_s:.3f}", err)
        if p.breakdown is None:
            t.add_row(str(p.nodes), str(p.critic_nodes), f"[red]{p.state}", "-", *pred, "-", "-", "-",
                      (p.error or "")[:60])
            continue
        split = ", ".join(f"{ph} {v:.3f}" for ph, v in zip(p.breakdown.phases, p.breakdown.mean_phase_s) if v > 0)
        t.add_row(str(p.nodes), str(p.critic_nodes), p.state, f"{p.step_s:.3f}", *pred, f"{p.samples_per_s:.1f}",
                  "-" if p.tokens_per_s is None else f"{p.tokens_per_s:.0f}", f"{100 * p.efficiency:.0f}%", split)
    return t


def cmd_scaling(args) -> int:
    from slurm_align.analysis.plots import plot_scaling
    from slurm_align.analysis.scaling import compute_scaling

    report = compute_scaling(args.sweep_dir, allow_incomplete=args.allow_incomplete,
                             skip_steps=args.skip_steps, console=console)
    if args.calibration:   # predicted beside measured
        from slurm_align.planning.calibration import calibrate, predict_scaling

        predict_scaling(report, calibrate(Path(args.calibration), skip_steps=args.calibration_skip_steps,
                                          dtype=args.dtype))
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    elif args.format == "csv":
        sys.stdout.write(_csv([{k: v for k, v in p.to_dict().items() if k != "phase_s"} for p in report.points]))
    else:
        _stdout().print(_scaling_table(report))
    if not args.no_plot:
        png = Path(args.png) if args.png else Path(args.sweep_dir) / "scaling.png"
        plot_scaling(report, png)
        console.print(f"chart: {png}", highlight=False)
    return 0 if any(p.breakdown is not None for p in report.points) else 1


def cmd_sweep(args) -> int:
    if args.nodes is None and not args.set:
        raise ConfigError.at("--nodes/--set", None, "give node counts (--nodes 1,2,4), settings "
                             "(--set ppo.actor_lr=1e-6,5e-6, repeatable) or both")
    run = load_run_config(args.config, args.overrides)
    profile = choose_profile(args.profile)   # --profile, else the hostname_pattern match (or refused)
    run = with_profile_defaults(run, profile)
    nodes = parse_nodes(args.nodes) if args.nodes is not None else None
    sets = [parse_set(s) for s in args.set]
    if args.predict or args.calibration:   # the predicted table first, so a bad plan can be stopped
        if nodes is None:
            raise ConfigError.at("--predict/--calibration", None,
                                 "predictions are per node count: give --nodes too")
        from slurm_align.planning.commands import load_calibration, prediction_table, sweep_predictions

        dtype = args.dtype or run.training.precision
        cal = load_calibration(args.calibration, args.skip_steps, dtype)
        points = plan_sweep(run, profile, nodes, args.mode)
        rows = sweep_predictions(points, cal, dtype)
        source = f"calibrated on {cal.run_dir}" if cal else "default efficiencies"
        _stdout().print(prediction_table(f"predicted step time ({source})", rows))
        for note in cal.notes([p.run for p in points]) if cal else []:
            console.print(f"note: {note}", highlight=False)
        if args.predict_only:
            return 0
    sweep_dir = Path(args.sweep_dir) if args.sweep_dir else new_run_dir(default_run_root(profile), "sweep")
    limit = args.max_concurrent or (1 if profile.kind == "local" else None)
    manifest = start_sweep(run, profile, nodes, args.mode if nodes else "strong", sweep_dir, args.config, sets,
                           entry=Entry(name=args.entry) if args.entry else None, max_concurrent=limit,
                           console=console, poll_s=args.poll_s)
    failed = [p for p in manifest.points if p.state != "COMPLETED"]
    for p in failed:
        console.print(f"[red]point {p.run_dir} {p.state}[/]: {p.error}", highlight=False)
    nxt = (f"analyze settings {manifest.sweep_dir} --metric val/score --metric timers/step:mean" if sets
           else f"analyze scaling {manifest.sweep_dir}")
    console.print(f"sweep directory: {manifest.sweep_dir}  (next: slurm-align {nxt})", highlight=False)
    return 1 if failed else 0


def cmd_settings(args) -> int:
    from slurm_align.analysis.settings import plot_settings, settings_report, write_csv

    rows = settings_report(Path(args.sweep_dir), args.metric)
    t = Table(title=f"settings sweep {args.sweep_dir}")
    keys = sorted({k for r in rows for k in r.settings})
    for col in ("point", *keys, "state", *args.metric):
        t.add_column(col)
    for r in rows:
        t.add_row(r.point, *(r.settings.get(k, "") for k in keys), r.state,
                  *(f"{r.values[m]:.4g}" for m in args.metric))
    _stdout().print(t)
    write_csv(rows, args.metric, Path(args.sweep_dir) / "settings.csv")
    if not args.no_plot:
        png = Path(args.png) if args.png else Path(args.sweep_dir) / "settings.png"
        plot_settings(rows, args.metric, png)
        console.print(f"chart: {png}", highlight=False)
    return 0


def _odd(n: int) -> int:
    """The largest odd count <= n (at least 1): a majority needs one."""
    return max(1, n if n % 2 else n - 1)


def cmd_heldout(args) -> int:
    """Held-out accuracy at each evaluation of a run (RUN_DIR/eval/step_<N>.jsonl), each against
    the initial policy's on the same prompts: the prompts that changed (b wrong -> right, c right
    -> wrong) and the exact one-sided sign test's p-value; then the end (the last --pool
    evaluations, an odd number of them, a prompt solved where most of them solved it) against the
    start, and against another run's end (--against)."""
    from slurm_align.analysis.significance import paired_counts, pooled_correct, same_prompts
    from slurm_align.rundir import RunDir

    def steps_of(run_dir: Path) -> list[int]:
        steps = RunDir(run_dir).eval_steps()
        if not steps:
            raise ConfigError.at("RUN_DIR", str(run_dir), "has no per-prompt evaluation (eval/step_<N>.jsonl): "
                                 "a rollout run with eval.interval > 0 writes them")
        return steps

    run = Path(args.run_dir)
    steps = steps_of(run)
    start = pooled_correct(run, [steps[0]])
    t = Table(title=f"{run}: held-out accuracy against step {steps[0]} ({len(start)} prompts)")
    for col in ("step", "accuracy", "b wrong->right", "c right->wrong", "p(better)", "p(worse)"):
        t.add_column(col, justify="right")
    for step in steps:
        c = paired_counts(start, pooled_correct(run, [step]))
        t.add_row(str(step), f"{c.acc_after:.3f}", str(c.b), str(c.c), f"{c.p_better:.2e}", f"{c.p_worse:.2e}")
    _stdout().print(t)
    later = [s for s in steps if s != steps[0]]
    end_steps = later[-_odd(min(args.pool, len(later))):] if later else []
    if end_steps:
        print(f"end (steps {end_steps}, pooled) against step {steps[0]}: "
              f"{paired_counts(start, pooled_correct(run, end_steps))}")
    if args.against:
        other = Path(args.against)
        other_steps = steps_of(other)
        if not same_prompts(run, steps[0], other, other_steps[0]):
            raise ConfigError.at("--against", str(other), f"evaluated other prompts than {run}: no pairing")
        other_later = [s for s in other_steps if s != other_steps[0]]
        other_end = other_later[-_odd(min(args.pool, len(other_later))):] if other_later else other_steps[-1:]
        mine = end_steps or steps[-1:]
        print(f"end of {other} (steps {other_end}) against the end of {run} (steps {mine}): "
              f"{paired_counts(pooled_correct(other, other_end), pooled_correct(run, mine))}")
    return 0


def register(sub) -> None:
    analyze = sub.add_parser("analyze", help="analyse runs and sweeps from their Zarr traces")
    asub = analyze.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")

    def common(p):
        p.add_argument("--allow-incomplete", action="store_true",
                       help="go on with the ranks and steps that are there")
        p.add_argument("--format", choices=("table", "json", "csv"), default="table")
        p.add_argument("--skip-steps", type=int, default=0, help="leave out the first N steps (warm-up)")
        p.add_argument("--png", help="chart path (default: under the run or sweep directory)")
        p.add_argument("--no-plot", action="store_true")

    p = asub.add_parser("breakdown", help="step time per phase (max over ranks), idle per rank, chart")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="more runs side by side (ablation view)")
    p.add_argument("--per-step", action="store_true", help="also a table with every step as a column")
    p.add_argument("--timeline-step", type=int, default=None,
                   help="step drawn as a swimlane timeline (default: the last one analysed)")
    common(p)
    p.set_defaults(func=cmd_breakdown)

    p = asub.add_parser("trace", help="Chrome/Perfetto trace JSON of every span")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default="trace.json")
    p.add_argument("--allow-incomplete", action="store_true")
    p.set_defaults(func=cmd_trace)

    p = asub.add_parser("settings", help="chosen metrics of every point of a settings sweep: table, csv, chart")
    p.add_argument("sweep_dir", metavar="SWEEP_DIR")
    p.add_argument("--metric", action="append", required=True,
                   help="a metrics.jsonl key (its last value) or KEY:mean (its mean over the steps); repeatable")
    p.add_argument("--png", help="chart path (default: SWEEP_DIR/settings.png)")
    p.add_argument("--no-plot", action="store_true")
    p.set_defaults(func=cmd_settings)

    p = asub.add_parser("scaling", help="scaling table and chart of a sweep directory")
    p.add_argument("sweep_dir", metavar="SWEEP_DIR")
    p.add_argument("--calibration", default=None, metavar="RUN_DIR",
                   help="show each point's step time predicted from this run's calibration beside the measured")
    p.add_argument("--calibration-skip-steps", type=int, default=1, help="warm-up steps of the calibration run")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="fp32")
    common(p)
    p.set_defaults(func=cmd_scaling)

    p = asub.add_parser("heldout", help="held-out accuracy per evaluation, paired per prompt, with exact sign tests")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--pool", type=int, default=3,
                   help="the end point: a prompt's majority over the last N evaluations (an even N pools N - 1)")
    p.add_argument("--against", metavar="RUN", help="another run of the same held-out prompts: its end against this")
    p.set_defaults(func=cmd_heldout)

    p = sub.add_parser("sweep", help="one job per node count, a manifest and live progress")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run config overrides")
    p.add_argument("--profile", default=None)
    p.add_argument("--nodes", default=None, help="actor node counts, e.g. 1,2,4,8")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                   help="a grid over a run-config field (repeatable): one point per combination")
    p.add_argument("--mode", choices=("weak", "strong"), default="weak")
    p.add_argument("--sweep-dir", default=None, help="default: a new runs/sweep-<time> folder")
    p.add_argument("--entry", default=None, help="launcher in launchers/ to run instead of the default")
    p.add_argument("--max-concurrent", type=int, default=None,
                   help="points running at once (default: 1 on a local profile, all on Slurm)")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between state checks")
    p.add_argument("--predict", action="store_true",
                   help="print each point's predicted step time before submitting (slurm-align plan)")
    p.add_argument("--predict-only", action="store_true", help="with --predict: print it and submit nothing")
    add_prediction_arguments(p)
    p.set_defaults(func=cmd_sweep)
