"""The commands the documentation shows (docs/**/*.md and README.md) are ones the code accepts:
every `slurm-align ...` in a ```bash block, an indented README block or an inline code span parses
with the CLI's own parser, each of its `a.b=c` overrides names a real run-config field (`-P` ones
a profile field), and every repository file a command names exists. A renamed option, field or
example then fails here rather than in a reader's terminal. Synopses with [optional] parts go
in ```text blocks, which are not checked. (Running the commands is the examples' own tests' job.)"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.cli import build_parser
from tests.support.doc_commands import PROGRAMS, check_cli, check_paths

PAGES = [*sorted((REPO_ROOT / "docs").rglob("*.md")), REPO_ROOT / "README.md"]


def shell_lines(text: str, readme: bool) -> list[str]:
    """Command lines of ```bash blocks (and of a README's 4-space-indented blocks), continuations
    joined, comments dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    if readme:
        blocks += ["\n".join(line[4:] for line in m.splitlines())
                   for m in re.findall(r"(?:^ {4,}\S.*\n)+", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S),
                                       flags=re.M)]
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                lines.extend(part.strip() for part in line.split("&&"))
    return lines


def commands(page: Path) -> list[str]:
    text = page.read_text()
    found = shell_lines(text, readme=page.name == "README.md")
    # inline spans: a whole command (the prose also names bare commands, `slurm-align status`)
    found += [span for span in re.findall(r"`([^`\n]+)`", text)
              if span.startswith(tuple(f"{p} " for p in PROGRAMS)) and len(span.split()) > 2]
    return found


CASES = [(p, c) for p in PAGES for c in commands(p)]


@pytest.mark.parametrize(("page", "command"), CASES, ids=[f"{p.name}:{c[:60]}" for p, c in CASES])
def test_documented_command_is_accepted(page: Path, command: str):
    words = shlex.split(command)
    check_paths(words)
    if words[0] in PROGRAMS:
        check_cli(words[1:])
    elif words[:2] == [".venv/bin/python", "-m"] and words[2].startswith(("tests.", "slurm_align.")):
        module = words[2].replace(".", "/")
        assert (REPO_ROOT / module).is_dir() or (REPO_ROOT / f"{module}.py").exists(), words[2]


def test_the_pages_show_commands_of_every_kind():
    """The extraction finds what the pages hold (a regex that found nothing would pass above)."""
    kinds = {c.split()[0] for _, c in CASES}
    assert {".venv/bin/slurm-align", "slurm-align", "bash", ".venv/bin/python"} <= kinds, kinds
    assert len(CASES) > 30


def test_a_wrong_option_or_field_is_caught():
    with pytest.raises(AssertionError, match="unrecognized arguments"):
        check_cli(["submit", "examples/grpo_tiny.yaml", "--profiel", "local"])
    with pytest.raises(AssertionError, match="refuses"):
        check_cli(["submit", "examples/grpo_tiny.yaml", "--profile"])
    with pytest.raises(AssertionError, match="ppo has"):
        check_cli(["submit", "examples/grpo_tiny.yaml", "ppo.num_step=3"])
    with pytest.raises(AssertionError, match=r"components\.actor\.node"):
        check_cli(["submit", "examples/grpo_tiny.yaml", "-P", "components.actor.node=3"])
    with pytest.raises(AssertionError, match="does not exist"):
        check_paths(["examples/grpo_tiy.yaml"])
    assert isinstance(build_parser(), argparse.ArgumentParser)
