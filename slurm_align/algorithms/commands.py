"""`slurm-align train {sft,rm,dpo,kto} CONFIG --profile NAME [--run-dir DIR] [--follow] [a.b=c ...]`

Loads and validates the run config (algorithm set from the subcommand) against the profile,
writes the resolved config into the run directory and launches it (local mpirun ranks or a
plain Slurm job); every rank runs launchers/train.py.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from slurm_align.slurm.commands import _report_final, add_run_arguments, load_inputs
from slurm_align.slurm.launch import launch_run

TRAIN_ALGORITHMS = {"sft": "supervised fine-tuning on {input, output} JSONL",
                    "rm": "reward model on {prompt, chosen, rejected} JSONL (Bradley-Terry) or on {input, output, "
                          "<attribute>...} (loss.name=regression)",
                    "dpo": "DPO / IPO / RPO (loss.options.preference_loss) against the frozen initial policy on "
                           "{prompt, chosen, rejected} JSONL",
                    "kto": "KTO against the frozen initial policy on {input, output, label} JSONL"}


def cmd_train(args: argparse.Namespace) -> int:
    out, err = Console(), Console(stderr=True)
    run, profile, run_dir = load_inputs(args, algorithm=args.algorithm)
    job = launch_run(run, profile, run_dir)
    out.print(f"{args.algorithm}: job [bold]{job.job_id}[/] ({job.record.backend}, profile {profile.name})")
    out.print(f"run directory: {job.run_dir.root}  (metrics: {job.run_dir.root / 'metrics.jsonl'})")
    if args.follow:
        return _report_final(job, job.wait(console=err))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="train with SFT, a reward model, DPO or KTO (one job component)")
    algos = p.add_subparsers(dest="algorithm", required=True, metavar="ALGORITHM")
    for name, help_text in TRAIN_ALGORITHMS.items():
        a = algos.add_parser(name, help=help_text)
        add_run_arguments(a)
        a.add_argument("--follow", action="store_true", help="wait for the job and show its state")
        a.set_defaults(func=cmd_train)
