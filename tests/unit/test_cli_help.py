"""Every CLI command's --help ends with an example (slurm_align/cli_help.py), and the examples are
ones the CLI takes: each parses with the parser and names real fields and files; the cheap ones
(nothing submitted, no run needed) run here and succeed."""

from __future__ import annotations

import shlex

import pytest

from slurm_align import REPO_ROOT
from slurm_align.cli import build_parser, main
from slurm_align.cli_help import EXAMPLES, leaves
from tests.support.doc_commands import check_cli, check_paths

ALL = [(words, example) for words, examples in EXAMPLES.items() for example in examples]
# Examples that only read the repository and print: run, not just parsed.
RUNNABLE = {("config", "explain"), ("plan",), ("render",)}


def test_every_command_has_an_example_and_every_example_a_command():
    commands = {words for words, _, _ in leaves(build_parser())}
    assert len(commands) > 20   # the walk finds the tree (a walk that found nothing would pass)
    assert sorted(commands - EXAMPLES.keys()) == [], "commands without an example in cli_help.EXAMPLES"
    assert sorted(EXAMPLES.keys() - commands) == [], "examples of commands the CLI does not have"


@pytest.mark.parametrize(("words", "example"), ALL, ids=[e[12:70] for _, e in ALL])
def test_example_parses_and_names_real_fields_and_files(words, example):
    argv = shlex.split(example)
    assert argv[0] == "slurm-align" and tuple(argv[1:1 + len(words)]) == words, example
    check_paths(argv)
    check_cli(argv[1:])


def test_help_shows_the_purpose_and_the_examples(capsys):
    for words, parser, _ in leaves(build_parser()):
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        text = capsys.readouterr().out
        assert "examples:\n  " + EXAMPLES[words][0] in text, words
        assert parser.description, f"{words}: no one-line purpose"
        assert " ".join(parser.description.split())[:40] in " ".join(text.split()), words


@pytest.mark.parametrize(("words", "example"), [(w, e) for w, e in ALL if w in RUNNABLE],
                         ids=[e[12:70] for w, e in ALL if w in RUNNABLE])
def test_cheap_example_runs(words, example, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO_ROOT)   # the examples name repository paths
    monkeypatch.setenv("SLURM_ALIGN_RUNS_DIR", str(tmp_path))
    assert main(shlex.split(example)[1:]) == 0, example
    assert capsys.readouterr().out.strip(), f"{example} printed nothing"
