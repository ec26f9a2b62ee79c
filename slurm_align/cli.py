"""The `slurm-align` command. Each area adds its own subcommands through a `register(sub)` hook."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from slurm_align.config.errors import ConfigError

console = Console(stderr=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurm-align",
        description="Slurm-native RLHF: PPO as one actor+critic heterogeneous job, SFT/RM/DPO jobs, "
                    "step-time breakdowns and scaling sweeps.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Imported here so `slurm-align --help` stays fast and each area owns its commands.
    from slurm_align.slurm import commands as slurm_commands
    slurm_commands.register(sub)
    for module in ("slurm_align.algorithms.commands", "slurm_align.analysis.commands",
                   "slurm_align.models.hf.commands"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.register(sub)
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
        console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
