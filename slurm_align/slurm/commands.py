"""`slurm-align submit | render | status | cancel`: the login-node side of a run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from slurm_align.config.loading import check_against_profile, load_profile, load_run_config
from slurm_align.rundir import new_run_dir
from slurm_align.slurm.launch import find_job, launch_run
from slurm_align.slurm.render import Entry, render_script

out = Console()
err = Console(stderr=True)


def add_run_arguments(p: argparse.ArgumentParser, *, with_config: bool = True) -> None:
    """CONFIG, --profile, --run-dir and dotted overrides: shared by submit, render, train, sweep."""
    if with_config:
        p.add_argument("config", type=Path, help="run config YAML (see examples/)")
    p.add_argument("--profile", default=None,
                   help="profile name (cluster_profiles/ or $SLURM_ALIGN_PROFILE_PATH) or a .yaml path; "
                        "default: 'local'")
    p.add_argument("-P", "--profile-set", action="append", default=[], metavar="a.b=c",
                   help="override a profile field (repeatable), e.g. -P partition=gpu")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default: a new folder under ./runs/)")
    p.add_argument("overrides", nargs="*", metavar="a.b=c", help="dotted overrides of the run config")


def load_inputs(args: argparse.Namespace, algorithm: str | None = None):
    """Run config (with overrides and algorithm), profile and run directory, all validated."""
    overrides = list(args.overrides)
    if algorithm:
        overrides.append(f"algorithm={algorithm}")
    run = load_run_config(args.config, overrides)
    profile = load_profile(args.profile, args.profile_set)
    check_against_profile(run, profile, source=args.config)
    run_dir = args.run_dir or run.run_dir or new_run_dir("runs", run.algorithm)
    return run, profile, Path(run_dir)


def _entry(args: argparse.Namespace) -> Entry:
    return Entry(args.entry) if getattr(args, "entry", None) else Entry()


def cmd_render(args: argparse.Namespace) -> int:
    run, profile, run_dir = load_inputs(args)
    sys.stdout.write(render_script(run, profile, run_dir.resolve(), _entry(args)))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    run, profile, run_dir = load_inputs(args)
    job = launch_run(run, profile, run_dir, entry=_entry(args))
    out.print(f"submitted job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})")
    out.print(f"run directory: {job.run_dir.root}")
    if args.follow:
        final = job.wait(console=err)
        return _report_final(job, final)
    return 0


def _report_final(job, final: str) -> int:
    out.print(f"job {job.job_id}: [bold]{final}[/]")
    if final != "COMPLETED":
        for comp, logs in job.failed_logs().items():
            out.print(f"  {comp} failed; logs:")
            for log in logs:
                out.print(f"    {log}")
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    job = find_job(args.job)
    comps = job.component_states()
    if args.json:
        print(json.dumps({"job_id": job.job_id, "state": job.state(), "components": comps}))
        return 0
    out.print(job._table(comps))
    for comp, logs in job.failed_logs().items():
        out.print(f"{comp} failed; logs: " + ", ".join(str(p) for p in logs))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = find_job(args.job)
    job.cancel()
    out.print(f"cancelled job {job.job_id}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("submit", help="validate, render and submit a run (one hetjob for PPO)")
    add_run_arguments(p)
    p.add_argument("--follow", action="store_true", help="show the components' states until the job ends")
    p.add_argument("--entry", default=None,
                   help="launcher to run instead of the algorithm's (e.g. 'report' to check a profile)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("render", help="print the job script without submitting")
    add_run_arguments(p)
    p.add_argument("--entry", default=None, help="launcher to run instead of the algorithm's")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("status", help="state of a submitted run's components")
    p.add_argument("job", help="run directory or job id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a submitted run")
    p.add_argument("job", help="run directory or job id")
    p.set_defaults(func=cmd_cancel)
