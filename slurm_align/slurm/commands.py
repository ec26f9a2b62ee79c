"""`slurm-align submit | render | status | cancel`: the login-node side of a run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import (
    apply_overrides,
    check_against_profile,
    load_run_config,
    read_yaml,
    validate,
    with_profile_defaults,
)
from slurm_align.config.memory_plan import check_memory
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.rundir import RunDir, new_run_dir
from slurm_align.slurm import pipeline_commands
from slurm_align.slurm import state as job_state
from slurm_align.slurm.choose import choose_profile, default_run_root
from slurm_align.slurm.launch import find_job, launch_run
from slurm_align.slurm.pipeline import is_pipeline_dir
from slurm_align.slurm.pipeline_commands import print_pipeline_status
from slurm_align.slurm.render import Entry, render_script
from slurm_align.slurm.status import run_status

out = Console()
err = Console(stderr=True)


def add_run_arguments(p: argparse.ArgumentParser, *, with_config: bool = True, optional_config: bool = False) -> None:
    """CONFIG, --profile, --run-dir and dotted overrides: shared by submit, render, train, sweep."""
    if optional_config:   # submit --resume RUN_DIR takes the run's own config
        p.add_argument("config", type=Path, nargs="?", default=None,
                       help="run config YAML (see examples/); not with --resume")
    elif with_config:
        p.add_argument("config", type=Path, help="run config YAML (see examples/)")
    p.add_argument("--profile", default=None,
                   help="profile name (cluster_profiles/ or $SLURM_ALIGN_PROFILE_PATH) or a .yaml path; "
                        "default: the profile whose hostname_pattern matches this machine, else 'local' "
                        "where there is no sbatch")
    p.add_argument("-P", "--profile-set", action="append", default=[], metavar="a.b=c",
                   help="override a profile field (repeatable), e.g. -P partition=gpu")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="run directory (default: a new folder under the profile's run_root, else ./runs/)")
    p.add_argument("overrides", nargs="*", metavar="a.b=c", help="dotted overrides of the run config")


def load_inputs(args: argparse.Namespace, algorithm: str | None = None):
    """Run config (with overrides and algorithm), profile and run directory, all validated."""
    if args.config is None:
        raise ConfigError.at("CONFIG", None, "a run config YAML is required (or --resume RUN_DIR)")
    overrides = list(args.overrides)
    if algorithm:
        overrides.append(f"algorithm={algorithm}")
    run = load_run_config(args.config, overrides)
    profile = choose_profile(args.profile, args.profile_set)
    check_against_profile(run, profile, source=args.config)
    run = with_profile_defaults(run, profile)
    run_dir = args.run_dir or run.run_dir or new_run_dir(default_run_root(profile), run.algorithm)
    return run, profile, Path(run_dir)


def _entry(args: argparse.Namespace) -> Entry:
    return Entry(args.entry) if getattr(args, "entry", None) else Entry()


def parse_after(text: str | None) -> list[str]:
    """'12:13' -> ['12', '13'] (Slurm job ids, as sbatch --dependency=afterok takes them)."""
    if text is None:
        return []
    ids = text.split(":")
    if not all(i.isdigit() for i in ids):
        raise ConfigError.at("--after", text, "Slurm job ids separated by ':', e.g. 1234 or 1234:1235")
    return ids


def cmd_render(args: argparse.Namespace) -> int:
    run, profile, run_dir = load_inputs(args)
    sys.stdout.write(render_script(run, profile, run_dir.resolve(), _entry(args)))
    return 0


def resume_inputs(args: argparse.Namespace):
    """The run config and profile a run directory was submitted with (config.yaml, profile.yaml),
    with this command's overrides on top (e.g. more steps, a longer time limit)."""
    rd = RunDir(Path(args.resume).resolve())
    overrides = list(args.overrides)
    if args.config is not None and "=" in str(args.config):   # argparse gave the first override to CONFIG
        overrides, args.config = [str(args.config), *overrides], None
    if not rd.is_run_dir() or not rd.profile.is_file():
        raise ConfigError.at("--resume", str(args.resume), "not a run directory (config.yaml and profile.yaml "
                             "are written by `slurm-align submit`)")
    if args.config is not None or args.profile is not None or args.run_dir is not None:
        raise ConfigError.at("--resume", str(args.resume), "takes the run's own config, profile and directory: "
                             "give overrides (a.b=c, -P a.b=c) instead of CONFIG, --profile or --run-dir")
    run = validate(RunConfig, apply_overrides(read_yaml(rd.config), overrides), rd.config)
    profile = validate(ClusterProfile, apply_overrides(read_yaml(rd.profile), list(args.profile_set)), rd.profile)
    check_against_profile(run, profile, source=rd.config)
    return run, profile, rd.root


def cmd_submit(args: argparse.Namespace) -> int:
    run, profile, run_dir = resume_inputs(args) if args.resume else load_inputs(args)
    if not args.skip_memory_check:   # before anything is written or submitted
        check_memory(run, profile, source=str(args.config or args.resume))
    job = launch_run(run, profile, run_dir, entry=_entry(args), after=parse_after(args.after), here=args.here)
    out.print(f"submitted job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})"
              + (f", starts after job {', '.join(job.record.after)} completed" if job.record.after else ""))
    out.print(f"run directory: {job.run_dir.root}")
    if args.here:
        return _report_final(job, _wait_here(job))
    if args.follow:
        final = job.wait(console=err)
        return _report_final(job, final)
    return 0


def _wait_here(job) -> str:
    """--here runs in this shell: wait for it; a Ctrl-C stops it at a checkpoint, as a preemption
    would (resume later with submit --resume), and a second one cancels it."""
    try:
        return job.wait(console=err)
    except KeyboardInterrupt:
        err.print("stopping at the next checkpoint (Ctrl-C again cancels without saving)")
        job.stop()
    try:
        return job.wait(console=err)
    except KeyboardInterrupt:
        job.cancel()
        return job.wait()


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
    if is_pipeline_dir(Path(args.job)):
        return print_pipeline_status(Path(args.job).resolve(), args.json)
    job = find_job(args.job)
    st = run_status(job)
    if args.json:
        print(json.dumps(st.to_dict()))
        return 0
    out.print(job._table(st.components))
    out.print(f"state {st.state}; requeues {st.requeues}; last checkpoint at step "
              f"{'none' if st.last_checkpoint_step is None else st.last_checkpoint_step}", highlight=False)
    for r in st.restarts:   # fault_tolerance.max_restarts (slurm/restart.py)
        where = f"{r['component']} rank {r['rank']}" if r.get("component") else "the job"
        out.print(f"restart {r['count'] if r['retry'] else '-'}: job {r['job_id']} failed at step {r['failed_step']} "
                  f"({where}: {r['why'] or 'unknown'}); {r['reason']}", highlight=False)
        for line in r.get("dependents") or []:   # a pipeline stage's dependents, moved onto the new job
            out.print(f"  {line}", highlight=False)
    if st.pending_reasons:
        out.print(f"waiting: Slurm's reason {', '.join(sorted(set(st.pending_reasons)))}", highlight=False)
    if st.state == job_state.STOPPED:
        out.print(f"stopped for preemption at step {st.stopped_at_step}; resume with "
                  f"`slurm-align submit --resume {job.run_dir.root}`", highlight=False)
    if st.failed is not None:
        f = st.failed
        where = "before any rank started" if f.rank is None else f"rank {f.rank}"
        out.print(f"[red]{f.component} failed first[/] ({where}: {f.why}); last lines of {f.log}:")
        for line in f.tail:
            out.print(f"  {line}", highlight=False, markup=False)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = find_job(args.job)
    job.cancel()
    out.print(f"cancelled job {job.job_id}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("submit", help="validate, render and submit a run (one hetjob for PPO)")
    add_run_arguments(p, optional_config=True)
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="start a new job on an existing run: its config and profile, from its newest "
                        "checkpoint (overrides apply on top)")
    p.add_argument("--follow", action="store_true", help="show the components' states until the job ends")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="submit even if the memory plan exceeds the profile's gpu_memory_gib")
    p.add_argument("--entry", default=None,
                   help="launcher to run instead of the algorithm's (e.g. 'report' to check a profile)")
    p.add_argument("--here", action="store_true",
                   help="run the job's components as srun steps inside the allocation this shell holds "
                        "(salloc), not as a new job; waits for it, Ctrl-C stops it at a checkpoint")
    p.add_argument("--after", default=None, metavar="JOBID[:JOBID...]",
                   help="start only once these Slurm jobs completed successfully (afterok; cancelled if one "
                        "fails); inputs inside their run directories may be missing until then")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("render", help="print the job script without submitting")
    add_run_arguments(p)
    p.add_argument("--entry", default=None, help="launcher to run instead of the algorithm's")
    p.set_defaults(func=cmd_render)

    pipeline_commands.register(sub)

    p = sub.add_parser("status", help="state of a submitted run's components, or of a pipeline's stages")
    p.add_argument("job", help="run directory, pipeline directory or job id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="cancel a submitted run")
    p.add_argument("job", help="run directory or job id")
    p.set_defaults(func=cmd_cancel)
