"""`slurm-align label` and `slurm-align revise`: AI feedback in batch (label.py).

The judge asked is, in order: none with --random-labels; judge.remote of the config (an
OpenAI-compatible service); the judge component of a running job (--judge-run RUN_DIR); else
judge.model loaded in this process (one rank: a small judge).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig

# The judge's modules (torch, tritonclient) are imported by the commands that run, not by the CLI.


@contextlib.contextmanager
def open_judge(run: RunConfig, config_path: Path, judge_run: Path | None) -> Iterator[Any]:
    from slurm_align.judge.client import ComponentJudge, LocalJudge

    if run.judge.remote is not None:
        from slurm_align.judge.remote import RemoteJudge

        yield RemoteJudge(run.judge.remote)
        return
    if judge_run is not None:
        yield ComponentJudge(judge_run, connect_timeout_s=run.critic_server.connect_timeout_s,
                             request_timeout_s=run.critic_server.request_timeout_s)
        return
    if run.judge.model is None or run.judge.model.init_checkpoint is None:
        raise ConfigError(f"{config_path}: judge.model.init_checkpoint is not set (and no judge.remote, no "
                          "--judge-run): name a trained judge's checkpoints")
    from mpi4py import MPI

    from slurm_align.judge.model import JudgeModel
    from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
    from slurm_align.parallel.layout import initialize_model_parallel

    env = init_distributed(comm=MPI.COMM_SELF, backend="gloo")
    pctx = initialize_model_parallel(env, 1, 1)
    try:
        yield LocalJudge(JudgeModel.load(run.judge.model, pctx, seed=run.seed))
    finally:
        pctx.destroy()
        shutdown_distributed(env)


def _run(args) -> int:
    from slurm_align.judge import label as L
    from slurm_align.judge.prompts import JudgeTemplate

    run = load_run_config(args.config, args.overrides)
    samples = L.read_samples(args.samples)
    template = JudgeTemplate.get(run.judge.template)
    if args.command == "label" and args.random_labels:
        rows = L.label(samples, None, template, run.judge.principles, random_labels=True, seed=args.seed)
    elif args.command == "revise" and args.random_labels:
        rows = L.revise(samples, None, template, run.judge.principles, random_choice=True, seed=args.seed)
    else:
        with open_judge(run, args.config, args.judge_run) as judge:
            if args.command == "label":
                rows = L.label(samples, judge, template, run.judge.principles, min_margin=args.min_margin)
            else:
                rows = L.revise(samples, judge, template, run.judge.principles, min_margin=args.min_margin)
    L._write(args.out, rows)
    print(f"{args.command}: {len(rows)} rows from {len(samples)} prompts -> {args.out}")
    return 0


def register(sub) -> None:
    for name, help_text in (("label", "AI preference labels for sampled pairs, from the judge (RLAIF data)"),
                            ("revise", "self-critique + revision of sampled responses against the principles")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("samples", type=Path, help="`slurm-align generate` output (its folder or a JSONL of "
                                                  "prompt/response rows, several per prompt)")
        p.add_argument("--config", type=Path, required=True, help="run config whose `judge` section is used")
        p.add_argument("--out", type=Path, required=True, help="output JSONL (preference rows / SFT rows)")
        p.add_argument("--judge-run", type=Path, default=None,
                       help="run directory of a running judge component to ask (default: judge.model here)")
        p.add_argument("--random-labels", action="store_true",
                       help="no feedback, the control of an RLAIF experiment: label picks the chosen response "
                            "by a seeded coin, revise keeps a random response; no judge is asked")
        p.add_argument("--seed", type=int, default=0, help="seed of --random-labels")
        p.add_argument("--min-margin", type=float, default=0.0,
                       help="label: leave out pairs whose p(chosen) is below 0.5 + this; revise: leave out "
                            "prompts whose revision wins with a mean probability below 0.5 + this")
        p.add_argument("overrides", nargs="*", help="config overrides a.b=c")
        p.set_defaults(func=_run, command=name)


