"""The package's import arrows point down (issue 22): the packages the algorithms build on never
import slurm_align.algorithms, so the critic, the data, the launcher and the models can be used,
tested and changed without the actor's loop. Read from the source (every import statement,
also those inside functions), not by importing."""

from __future__ import annotations

import ast

import pytest

from slurm_align import REPO_ROOT

PACKAGE = REPO_ROOT / "slurm_align"
BELOW_ALGORITHMS = ["balance", "config", "critic", "data", "environments", "generation", "losses", "models", "parallel",
                    "profiling", "rewards", "slurm", "store"]


def imported_modules(path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("package", BELOW_ALGORITHMS)
def test_package_does_not_import_the_algorithms(package):
    upward = {f"{p.relative_to(REPO_ROOT)}: {m}" for p in sorted((PACKAGE / package).rglob("*.py"))
              for m in imported_modules(p) if m == "slurm_align.algorithms" or m.startswith("slurm_align.algorithms.")}
    assert not upward, f"slurm_align/{package} imports upward: {sorted(upward)}"


def test_the_check_sees_an_upward_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from slurm_align.algorithms.ppo import main\n")
    assert "slurm_align.algorithms.ppo" in imported_modules(f)


def test_the_cli_imports_no_plotting_store_or_torch():
    """Every `slurm-align` call (each job's steps, the CLI runs of the tests) imports the CLI:
    matplotlib, zarr and torch are imported by the commands that use them (~0.6 CPU-s a call)."""
    import subprocess
    import sys

    heavy = ("matplotlib", "zarr", "torch")
    prog = f"import sys, slurm_align.cli, slurm_align.critic.client; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"importing slurm_align.cli loads {out}"
