"""Trace store + Tracer: real concurrent writer processes, whole-step commits, missing ranks/steps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from slurm_align.profiling import phases
from slurm_align.profiling.timers import Tracer
from slurm_align.store.traces import read_traces

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
PER_STEP = (phases.GENERATE, phases.LOGPROBS, phases.TRAIN)

_WRITER = textwrap.dedent("""
    import os, sys, time
    from slurm_align.profiling.timers import Tracer
    run_dir, component, rank, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with Tracer(run_dir, component, rank) as tracer:
        for step in range(steps):
            for phase in {phases!r}:
                with tracer.span(phase, step):
                    time.sleep(0.001 * (rank + 1))
            tracer.step_done(step)
            if step == steps // 2 - 1:   # half-way: hold until the reader has seen steps of every writer
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(run_dir, "reader_saw_steps")):
                    assert time.monotonic() < deadline, "the reader never saw a whole step"
                    time.sleep(0.01)
""").format(phases=PER_STEP)
WRITERS = [("actor", 0), ("actor", 1), ("actor", 2), ("critic", 0)]


def test_concurrent_writers_lose_nothing_and_readers_see_whole_steps(tmp_path):
    steps = 12
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), comp, str(rank), str(steps)],
                              env=ENV, stderr=subprocess.PIPE, text=True)
             for comp, rank in WRITERS]
    # A reader polling while they write must only ever see whole steps. The writers hold half-way
    # until it has seen at least one whole step of each of them (the file below), so it surely
    # reads while they are still writing (their second half).
    seen_partial, reads_with_steps = [], 0
    while any(p.poll() is None for p in procs):
        if (tmp_path / "traces.zarr" / "zarr.json").exists():
            try:
                spans = read_traces(tmp_path / "traces.zarr").spans
            except (FileNotFoundError, KeyError):
                continue  # a rank group being created right now
            counts = {(comp, rank): int(np.sum((spans["component"] == comp) & (spans["rank"] == rank)))
                      for comp, rank in WRITERS}
            seen_partial += [(*key, n) for key, n in counts.items() if n % len(PER_STEP)]
            if all(n >= len(PER_STEP) for n in counts.values()):
                reads_with_steps += 1
                (tmp_path / "reader_saw_steps").touch()
        time.sleep(0.05)
    for p in procs:
        assert p.wait(timeout=60) == 0, p.stderr.read()
    assert reads_with_steps >= 1, "the reader never read a whole step of every writer while they wrote"
    assert not seen_partial
    table = read_traces(tmp_path / "traces.zarr", {"actor": 3, "critic": 1})
    assert table.complete, table.problems()
    assert table.ranks == {"actor": [0, 1, 2], "critic": [0]}
    s = table.spans
    assert len(s) == 4 * steps * len(PER_STEP)
    assert np.all(np.diff(s["start_ns"]) >= 0)  # sorted by start
    for comp, rank in WRITERS:
        mine = s[(s["component"] == comp) & (s["rank"] == rank)]
        assert sorted(mine["step"].tolist()) == sorted(list(range(steps)) * len(PER_STEP))
        # Each span slept (rank+1) ms: the recorded durations say so.
        assert np.all(mine["end_ns"] - mine["start_ns"] >= 1_000_000 * (rank + 1))
        # Spans of one rank do not overlap (they ran one after another).
        order = np.argsort(mine["start_ns"])
        assert np.all(mine["start_ns"][order][1:] >= mine["end_ns"][order][:-1])
    # Cross-process wall clock: all writers ran within the same few seconds.
    assert (s["end_ns"].max() - s["start_ns"].min()) < 60e9
    assert abs(s["start_ns"].min() / 1e9 - time.time()) < 120


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import slurm_align.store.traces as T
    from slurm_align.profiling.timers import Tracer
    tracer = Tracer(sys.argv[1], "actor", 0)
    for step in range(2):
        with tracer.span("generate", step): pass
        with tracer.span("train", step): pass
        tracer.step_done(step)
    real = T.TraceWriter._write
    def dying(self, start, rows):   # the rows reach disk, the commit never comes
        real(self, start, rows); os.kill(os.getpid(), signal.SIGKILL)
    T.TraceWriter._write = dying
    with tracer.span("generate", 2): pass
    with tracer.span("train", 2): pass
    tracer.step_done(2)
""")


def test_killed_flush_is_invisible_and_overwritten(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], env=ENV, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    table = read_traces(tmp_path / "traces.zarr")
    assert sorted(table.spans["step"].tolist()) == [0, 0, 1, 1]
    # A restarted rank resumes at step 2 and writes it whole.
    with Tracer(tmp_path, "actor", 0, resume_from_step=2) as tracer, tracer.span("refit", 2):
        pass
    spans = read_traces(tmp_path / "traces.zarr").spans
    assert sorted(zip(spans["step"].tolist(), spans["phase"].tolist())) == [
        (0, "generate"), (0, "train"), (1, "generate"), (1, "train"), (2, "refit")]


def test_resume_drops_redone_steps(tmp_path):
    with Tracer(tmp_path, "actor", 0) as t:
        for step in range(4):
            with t.span("train", step):
                pass
    with Tracer(tmp_path, "actor", 0, resume_from_step=2) as t:
        for step in (2, 3):
            with t.span("generate", step):
                pass
    spans = read_traces(tmp_path / "traces.zarr").spans
    assert sorted(zip(spans["step"].tolist(), spans["phase"].tolist())) == [
        (0, "train"), (1, "train"), (2, "generate"), (3, "generate")]


def test_missing_ranks_and_steps_are_named(tmp_path):
    for rank, steps in [(0, range(4)), (1, [0, 1, 3])]:
        with Tracer(tmp_path, "actor", rank) as t:
            for step in steps:
                t.record("train", step, 1000 * step, 1000 * step + 10)
    table = read_traces(tmp_path / "traces.zarr", {"actor": 3, "critic": 1})
    assert not table.complete
    assert table.missing_ranks == {"actor": [2], "critic": [0]}
    assert table.missing_steps["actor"] == {1: [2]}
    text = "\n".join(table.problems())
    assert "rank(s) 2" in text and "rank 1: missing step(s) 2" in text and "'critic'" in text


def test_disabled_tracer_writes_nothing(tmp_path):
    t = Tracer(tmp_path, "actor", 0, enabled=False)
    with t.span("train", 0):
        pass
    t.close()
    assert not (tmp_path / "traces.zarr").exists()
    assert t.span("train", 1) is t.span("generate", 2)  # one shared no-op context


def test_flushes_across_chunk_boundaries_and_truncation(tmp_path):
    """Thousands of spans in small flushes (each rewrites the last chunk whole from memory, the
    chunk boundary falls inside a flush), a reopened writer, and a truncation: nothing lost."""
    with Tracer(tmp_path, "actor", 0) as t:
        for step in range(300):
            for k in range(7):
                t.record(f"p{k}", step, 10 * (7 * step + k), 10 * (7 * step + k) + 5)
            t.step_done(step)
    with Tracer(tmp_path, "actor", 0) as t:   # a new process appends after the committed spans
        for step in range(300, 310):
            t.record("p0", step, 10 * 7 * step, 10 * 7 * step + 5)
    spans = read_traces(tmp_path / "traces.zarr").spans
    assert len(spans) == 300 * 7 + 10
    assert spans["start_ns"].tolist() == sorted(spans["start_ns"].tolist())
    assert spans["step"].tolist() == [s for s in range(300) for _ in range(7)] + list(range(300, 310))
    assert spans["phase"][:7].tolist() == [f"p{k}" for k in range(7)]
    with Tracer(tmp_path, "actor", 0, resume_from_step=250):
        pass
    assert sorted(set(read_traces(tmp_path / "traces.zarr").spans["step"].tolist())) == list(range(250))
