"""`slurm-align pipeline PIPELINE.yaml --profile NAME [--run-dir DIR] | --resume DIR` (slurm/pipeline.py),
and the pipeline view of `slurm-align status DIR`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slurm_align.config.errors import ConfigError
from slurm_align.rundir import new_run_dir
from slurm_align.slurm.choose import choose_profile, default_run_root
from slurm_align.slurm.pipeline import pipeline_status, resume_pipeline, submit_pipeline

out = Console()


def cmd_pipeline(args: argparse.Namespace) -> int:
    if args.resume is not None:
        if args.spec is not None or args.profile is not None or args.run_dir is not None:
            raise ConfigError.at("--resume", str(args.resume), "takes the pipeline's own file, profile and "
                                 "directory: give -P a.b=c to change the profile, nothing else")
        record, queued = resume_pipeline(args.resume, list(args.profile_set))
        root = Path(args.resume).resolve()
        out.print(f"queued again: {', '.join(queued) or 'nothing (every stage completed or is queued)'}")
    else:
        if args.spec is None:
            raise ConfigError.at("PIPELINE", None, "a pipeline YAML is required (or --resume DIR)")
        profile = choose_profile(args.profile, args.profile_set)
        root = Path(args.run_dir or new_run_dir(default_run_root(profile), "pipeline")).resolve()
        record = submit_pipeline(args.spec, profile, root)
    for stage in record.stages:
        after = f" after {', '.join(stage.after)}" if stage.after else ""
        out.print(f"stage {stage.name}: job {stage.job_id}{after}", highlight=False)
    out.print(f"pipeline directory: {root}  (slurm-align status {root})", highlight=False)
    return 0


def print_pipeline_status(root: Path, as_json: bool) -> int:
    stages = pipeline_status(root)
    if as_json:
        print(json.dumps({"pipeline": str(root), "stages": [asdict(s) for s in stages]}))
        return 0
    table = Table(title=f"pipeline {root}")
    for col in ("stage", "job", "state", "after", "checkpoint step", "note"):
        table.add_column(col)
    for s in stages:
        table.add_row(s.name, s.job_id or "-", s.state, ", ".join(s.after) or "-",
                      "-" if s.last_checkpoint_step is None else str(s.last_checkpoint_step), s.why)
    out.print(table)
    return 0


def register(sub) -> None:
    p = sub.add_parser("pipeline", help="queue a pipeline's stages (SFT -> RM -> PPO ...) at once, chained by "
                                        "Slurm dependencies")
    p.add_argument("spec", type=Path, nargs="?", default=None, metavar="PIPELINE",
                   help="pipeline YAML (see examples/pipeline_tiny.yaml); not with --resume")
    p.add_argument("--profile", default=None, help="a Slurm profile name or .yaml path")
    p.add_argument("-P", "--profile-set", action="append", default=[], metavar="a.b=c",
                   help="override a profile field (repeatable)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="pipeline directory (default: a new folder under the profile's run_root)")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="queue again the stages of this pipeline that did not complete")
    p.set_defaults(func=cmd_pipeline)
