"""slurm_align.launchers: `leave`, a component's process ends with its code and everything teardown
would have finished (threads, atexit handlers, MPI, stdio), without the teardown itself; and
`importing`, a component's imports without the garbage collector, their objects then frozen."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT

PROG = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    from mpi4py import MPI
    from slurm_align.launchers import leave

    out = Path(sys.argv[1])
    rank = MPI.COMM_WORLD.Get_rank()
    finalize = MPI.Finalize
    def finalize_and_say():
        finalize()
        (out / f"finalized.{rank}").write_text(str(MPI.Is_finalized()))
    MPI.Finalize = finalize_and_say

    class Teardown:   # a module global's finalizer runs in the teardown only
        def __del__(self, path=str(out / f"teardown.{rank}"), _open=open):   # bound now: globals go first
            with _open(path, "w") as f:
                f.write("ran")
    kept = Teardown()

    def late_write():   # a non-daemon thread still at work when main returns
        time.sleep(0.3)
        (out / f"thread.{rank}").write_text("done")
    threading.Thread(target=late_write).start()
    atexit.register(lambda: (out / f"atexit.{rank}").write_text("ran"))
    sys.stdout.write(f"rank {rank} unflushed")   # no newline, no flush
    leave(int(sys.argv[2]))
""")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def check(out: Path, rank: int) -> None:
    assert (out / f"thread.{rank}").read_text() == "done"        # joined, not killed
    assert (out / f"atexit.{rank}").read_text() == "ran"
    assert (out / f"finalized.{rank}").read_text() == "True"
    assert not (out / f"teardown.{rank}").exists()               # the teardown itself is skipped


def test_leave_ends_with_the_code_after_threads_atexit_mpi_and_stdout(tmp_path):
    proc = run([sys.executable, "-c", PROG, str(tmp_path), "7"])
    assert proc.returncode == 7, proc.stderr
    assert proc.stdout == "rank 0 unflushed"
    check(tmp_path, 0)


@pytest.mark.mpi
def test_ranks_that_leave_end_an_mpirun_cleanly(tmp_path):
    proc = run(["mpirun", "--oversubscribe", "-n", "2", sys.executable, "-c", PROG, str(tmp_path), "0"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(proc.stdout.replace("unflushed", "unflushed\n").split("\n")[:2]) == \
        ["rank 0 unflushed", "rank 1 unflushed"], proc.stdout
    for rank in (0, 1):
        check(tmp_path, rank)


IMPORTING = textwrap.dedent("""
    import gc
    from slurm_align.launchers import importing

    states = []
    with importing():
        states.append(gc.isenabled())
        made = [[i] for i in range(5000)]   # tracked by the collector, like a module's objects
    states.append(gc.isenabled())
    frozen = gc.get_freeze_count()
    try:
        with importing():
            raise ImportError("a failed import")
    except ImportError:
        states.append(gc.isenabled())
    print(states, frozen >= 5000)
""")


def test_importing_runs_without_the_collector_then_freezes_and_turns_it_back_on():
    """Inside the block the collector is off; after it (a failed import too) it is on again, and
    what the block made is frozen: out of every later collection's walk."""
    proc = run([sys.executable, "-c", IMPORTING])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[False,", "True,", "True]", "True"]


@pytest.mark.parametrize("launcher", ["actor", "critic", "evaluate", "generate", "generator", "judge",
                                      "teacher", "train"])
def test_every_heavy_launcher_imports_its_main_inside_importing(launcher):
    """The launchers whose ranks import torch and megatron do it inside `importing()` (a fifth to a
    third of a rank's import CPU: slurm_align.launchers.importing's docstring). Read off the source: running
    each launcher would import torch eight times for a check of one line."""
    source = (REPO_ROOT / "slurm_align" / "launchers" / f"{launcher}.py").read_text()
    block = source.split("with importing():\n", 1)
    assert len(block) == 2, f"{launcher}.py: no `with importing():` block"
    first = block[1].splitlines()[0].strip()
    assert first.startswith("from slurm_align.") and " import " in first, first
