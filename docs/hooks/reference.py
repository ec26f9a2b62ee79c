"""MkDocs hook: the reference pages are generated from the code at every build (never committed,
so they cannot drift): the run config's and the cluster profile's fields from their pydantic
models (slurm_align/config/reference.py), and every CLI command's --help from the parser."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

# The checkout being built, before any installed copy of the package: the pages describe this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slurm_align.cli import build_parser
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.reference import markdown
from slurm_align.config.run import RunConfig


def _commands(parser: argparse.ArgumentParser, words: list[str]) -> list[tuple[list[str], str, str]]:
    """(words, one-line purpose, --help) of every command and subcommand, depth first."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            purpose = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append(([*words, name], purpose.get(name, ""), sub.format_help()))
                out += _commands(sub, [*words, name])
    return out


def cli_markdown() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"   # argparse wraps to the terminal: the same page on every machine
    try:
        parser = build_parser()
        lines = ["# CLI reference", "", "Generated from the parser at build time: each command's `--help`.", "",
                 "```text", parser.format_help().rstrip(), "```", ""]
        for words, purpose, text in _commands(parser, ["slurm-align"]):
            lines += [f"## `{' '.join(words)}`", "", purpose[:1].upper() + purpose[1:] + ".", "",
                      "```text", text.rstrip(), "```", ""]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    pages = {"reference/config.md": markdown(RunConfig, "Run config reference"),
             "reference/profile.md": markdown(ClusterProfile, "Cluster profile reference"),
             "reference/cli.md": cli_markdown()}
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files
