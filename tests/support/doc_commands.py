"""Checks of a documented `slurm-align ...` command line without running it (shared by the
docs-page test and the --help examples' test): it parses with the CLI's own parser, its `a.b=c`
overrides name real run-config fields (`-P` ones profile fields), and the repository files it
names exist."""

from __future__ import annotations

import re
import shlex

from slurm_align import REPO_ROOT
from slurm_align.cli import build_parser
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.reference import explain
from slurm_align.config.run import RunConfig
from slurm_align.losses.registry import LOSSES

PROGRAMS = ("slurm-align", ".venv/bin/slurm-align")


def check_override(model, assignment: str) -> None:
    key = assignment.split("=", 1)[0]
    if model is RunConfig and key.startswith("loss.options."):   # the options of a registered loss
        option = key.removeprefix("loss.options.")
        assert any(option in spec.options.model_fields for spec in LOSSES.values()), \
            f"override {assignment!r}: no registered loss has the option {option!r}"
        return
    try:
        explain(model, key)
    except KeyError as e:
        raise AssertionError(f"override {assignment!r}: {e.args[0]}") from None


def check_cli(argv: list[str]) -> None:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as e:   # argparse's error exit (usage printed to stderr)
        raise AssertionError(f"slurm-align {shlex.join(argv)}: the CLI refuses it") from e
    assert all("=" in e and not e.startswith("-") for e in extra), f"unrecognized arguments: {extra}"
    for assignment in [*getattr(args, "overrides", []), *extra]:
        check_override(RunConfig, assignment)
    for assignment in getattr(args, "profile_set", None) or []:
        check_override(ClusterProfile, assignment)


def check_paths(words: list[str]) -> None:
    for w in words:
        value = w.split("=", 1)[-1]
        if re.match(r"^(examples|benchmarks|tests|cluster_profiles|\.ci|analysis)/", value):
            assert (REPO_ROOT / value).exists(), f"{value} does not exist in the repository"
