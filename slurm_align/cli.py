"""The `slurm-align` command. Each area adds its own subcommands through a `register(sub)` hook."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.text import Text

from slurm_align.algorithms import commands as algorithm_commands
from slurm_align.algorithms import steerlm_commands
from slurm_align.analysis import commands as analysis_commands
from slurm_align.cli_help import add_examples
from slurm_align.config import commands as config_commands
from slurm_align.config.errors import ConfigError
from slurm_align.judge import commands as judge_commands
from slurm_align.models.hf import commands as hf_commands
from slurm_align.planning import commands as planning_commands
from slurm_align.slurm import commands as slurm_commands

console = Console(stderr=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurm-align",
        description="Slurm-native RLHF: PPO as one actor+critic heterogeneous job, SFT/RM/DPO jobs, "
                    "step-time breakdowns and scaling sweeps.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for area in (slurm_commands, algorithm_commands, analysis_commands, hf_commands, config_commands,
                 planning_commands, judge_commands, steerlm_commands):
        area.register(sub)   # each area owns its subcommands
    add_examples(parser)   # one example per command (cli_help.py), at the end of its --help
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides (a.b=c) may come after options; argparse leaves those to us.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        # As plain text (a value such as `[rack1|rack2]` is not markup), never wrapped inside a
        # value (a path must stay copyable).
        console.print(Text.assemble(("error:", "bold red"), " ", str(e)), soft_wrap=True, highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
