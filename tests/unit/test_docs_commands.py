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


# Every ```bash block of the pages, and every transcript block, carries one mark on the line above:
#   <!-- docs-check: transcript -->          each `$ slurm-align ...` line runs here; the output the
#                                            page shows must appear, line by line in order, in what
#                                            the command prints now (a changed plan is a stale page)
#   <!-- docs-check: ran-by FILE::TEST -->   a named test runs the same thing: it exists, and its
#                                            module names every repository file and subcommand the
#                                            block does
#   <!-- docs-check: needs gpu|cluster -->   needs a GPU or a real cluster (placeholders such as
#                                            CONFIG.yaml or NAME): parsed above, not run
#   <!-- docs-check: long -->                minutes of CPU (the main job, a benchmark): parsed above;
#                                            the commands they run are each tested on their own
MARK = re.compile(r"<!-- docs-check: (transcript|ran-by (\S+)::(\w+)|needs (?:gpu|cluster)|long) -->")


def marked_blocks(page: Path) -> list[tuple[int, str | None, str]]:
    """(line, the mark above or None, body) of each ```bash block and each marked ``` block."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.fullmatch(above.strip())
            if lines[i] == "```bash" or mark:
                out.append((i + 1, mark.group(1) if mark else None, "\n".join(lines[i + 1:end])))
            i = end
        i += 1
    return out


BLOCKS = [(p, line, mark, body) for p in PAGES for line, mark, body in marked_blocks(p)]


@pytest.mark.parametrize(("page", "line", "mark", "body"), BLOCKS,
                         ids=[f"{p.relative_to(REPO_ROOT)}:{line}" for p, line, _, _ in BLOCKS])
def test_every_shown_command_block_is_run_or_marked(page: Path, line: int, mark: str | None, body: str):
    where = f"{page.relative_to(REPO_ROOT)}:{line}"
    assert mark, f"{where}: a ```bash block without a `<!-- docs-check: ... -->` mark above it"
    if mark.startswith("ran-by"):
        path, name = MARK.fullmatch(f"<!-- docs-check: {mark} -->").group(2, 3)
        module = REPO_ROOT / path
        assert module.is_file(), f"{where}: {path} does not exist"
        text = module.read_text()
        assert re.search(rf"^def {name}\(", text, flags=re.M), f"{where}: {path} has no test {name}"
        commands = shell_lines(f"```bash\n{body}\n```\n", readme=False)
        words = [w.split("=", 1)[-1] for cmd in commands for w in shlex.split(cmd)]
        # the example files the block runs (by name, or their folder's: tests reach them as
        # EXAMPLES / "x.yaml"), the module it runs, or, for the user's own files, the subcommand
        needed = [Path(w).name if Path(w).parent.name in ("examples", "benchmarks") else Path(w).parent.name
                  for w in words if re.match(r"^(examples|benchmarks)/", w)] or \
            [cmd.split()[2] for cmd in commands if cmd.split()[1:2] == ["-m"]] or \
            [cmd.split()[2] if cmd.split()[1] in ("train", "analyze", "import", "export") else cmd.split()[1]
             for cmd in commands if cmd.split()[0] in PROGRAMS]
        missing = [w for w in needed if w not in text]
        assert needed and not missing, f"{where}: {path} never names {missing or body}: does it run this block?"


TRANSCRIPTS = [(p, line, body) for p, line, mark, body in BLOCKS if mark == "transcript"]


@pytest.mark.parametrize(("page", "line", "body"), TRANSCRIPTS,
                         ids=[f"{p.relative_to(REPO_ROOT)}:{line}" for p, line, _ in TRANSCRIPTS])
def test_transcript_shows_what_the_command_prints(page, line, body, capsys, monkeypatch):
    from slurm_align.cli import main

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("COLUMNS", "200")
    runs = re.split(r"^\$ ", body.replace("\\\n", " "), flags=re.M)[1:]
    assert runs, f"{page}:{line}: a transcript without `$ ` lines"
    for run in runs:
        command, *shown = run.splitlines()
        argv = shlex.split(command)
        assert argv[0] == "slurm-align", command
        main(argv[1:])
        out = capsys.readouterr()
        printed = [" ".join(x.split()) for x in (out.out + out.err).splitlines()]
        at = 0
        for want in (" ".join(s.split()) for s in shown if s.strip()):
            assert want in printed[at:], (f"{page.relative_to(REPO_ROOT)}:{line}: `{command}` no longer prints\n"
                                          f"  {want}\nit prints:\n" + "\n".join(printed))
            at = printed.index(want, at) + 1


def test_the_marks_are_found():
    kinds = {mark.split()[0] for _, _, mark, _ in BLOCKS if mark}
    assert {"transcript", "ran-by", "needs"} <= kinds, kinds


def test_every_benchmark_is_on_the_performance_page():
    page = (REPO_ROOT / "docs" / "performance.md").read_text()
    scripts = sorted(p.name for p in (REPO_ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) > 10
    assert [s for s in scripts if f"`{s}`" not in page] == [], "benchmarks missing from docs/performance.md"


def test_every_opt_in_switch_is_listed():
    """A test skipped unless SLURM_ALIGN_<NAME>=1 is in tests/README.md's table of opt-in runs (which
    docs/testing.md includes): a run nobody can find is a run nobody makes."""
    table = (REPO_ROOT / "tests" / "README.md").read_text().split("## Opt-in runs", 1)[-1]
    # read with no default: a switch (a setting with a default, e.g. a step count, is not one);
    # conftest.py's CPU report takes a file name and is described below the table
    switches = {m for path in (REPO_ROOT / "tests").rglob("*.py") if path.name != "conftest.py"
                for m in re.findall(r"""environ\.get\(["'](SLURM_ALIGN_[A-Z0-9_]+)["']\)""", path.read_text())}
    assert "SLURM_ALIGN_CAI" in switches and len(switches) >= 5, switches
    assert sorted(s for s in switches if f"`{s}`" not in table) == [], "opt-in switches missing from tests/README.md"
