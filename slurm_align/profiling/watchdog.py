"""Hang detection: a per-rank watchdog that ends the job when the rank makes no progress.

A rank that hangs (a stuck collective, a deadlocked engine, a dead NFS mount) would hold its
nodes until the time limit. Progress is a traced span closing (profiling/timers.py calls
`progress`), or a trainer step ending. When none came for `hang_timeout_s`, the watchdog's thread
- dumps every thread's Python stack into the rank's log (faulthandler; the rank's stderr) and
  into logs/<component>/stacks_rank<N>.txt,
- writes logs/<component>/hang_rank<N>.json: this rank, its open phase, how long it was idle,
  and the SUSPECT with its phase: of the component's ranks, one whose process no longer runs at
  all (its heartbeat file is stale: SIGSTOPped, swapped out, stuck in the kernel), else the one
  whose last progress is oldest (blocked first; its peers then wait for it in a collective),
- and ends the process with HUNG_EXIT_CODE, which ends the job as a failure `slurm-align status`
  reports as a hang (slurm/status.py).
Every rank's watchdog thread also rewrites logs/<component>/heartbeat_rank<N>.json (last progress,
open phase, and `alive`: now) at each poll, which is how the firing rank finds the suspect: a
stopped rank cannot speak for itself, and a rank blocked in a collective still says it is alive.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from slurm_align.rundir import current_start

HUNG_EXIT_CODE = 86
"""Exit status of a rank its watchdog ended (distinct from a crash, 1, and a stop for preemption, 75)."""
HEARTBEAT_EVERY_S = 1.0
"""Heartbeat files are rewritten at most this often (progress itself is tracked in memory)."""


def heartbeat_path(logs: Path, rank: int) -> Path:
    return Path(logs) / f"heartbeat_rank{rank}.json"


def hang_report_path(logs: Path, rank: int) -> Path:
    return Path(logs) / f"hang_rank{rank}.json"


def stacks_path(logs: Path, rank: int) -> Path:
    return Path(logs) / f"stacks_rank{rank}.txt"


class Watchdog:
    """One rank's watchdog. `logs`: RUN_DIR/logs/<component>. `enter`/`progress` are cheap (called
    around every span); the thread wakes every `poll_s`."""

    def __init__(self, timeout_s: float, logs: Path, rank: int, *, poll_s: float | None = None,
                 end: Callable[[int], None] = os._exit):
        self.timeout_s, self.logs, self.rank = float(timeout_s), Path(logs), int(rank)
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.1, self.timeout_s / 10))
        self._end = end
        self._last = time.monotonic()
        self._last_wall = time.time()
        self._open: list[tuple[str, int]] = []   # spans open now (nested), innermost last
        self._written = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-rank{rank}", daemon=True)
        self.logs.mkdir(parents=True, exist_ok=True)

    # --- called by the rank's own threads ----------------------------------------------------
    def enter(self, phase: str, step: int) -> None:
        self._open.append((phase, int(step)))
        self._beat(force=len(self._open) == 1)

    def progress(self, phase: str | None = None, step: int | None = None) -> None:
        """A span of `phase` closed (or, without a phase, a step ended): the rank is alive."""
        self._last, self._last_wall = time.monotonic(), time.time()
        if phase is not None and self._open and self._open[-1][0] == phase:
            self._open.pop()
        self._beat()

    def start(self) -> Watchdog:
        self._beat(force=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:   # its beat in flight
            # must not land after the last one
            self._thread.join(timeout=10 * self.poll_s + 5)
        self._beat(force=True)

    # --- the watchdog's thread ----------------------------------------------------------------
    def _phase(self) -> tuple[str | None, int | None]:
        return self._open[-1] if self._open else (None, None)

    def _beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written < HEARTBEAT_EVERY_S:
            return
        self._written = now
        phase, step = self._phase()
        with contextlib.suppress(OSError):   # a full disk must not take the rank down
            _write(heartbeat_path(self.logs, self.rank), {"rank": self.rank, "time": self._last_wall, "phase": phase,
                                                          "step": step, "start": current_start(),
                                                          "alive": time.time(), "poll_s": self.poll_s,
                                                          "pid": os.getpid(), "host": socket.gethostname()})

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._beat(force=True)   # alive, whether or not the rank progresses
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        phase, step = self._phase()
        self._beat(force=True)
        where = f"in phase {phase} of step {step}" if phase else "outside any traced phase"
        msg = (f"slurm-align watchdog: rank {self.rank} made no progress for {idle:.0f} s {where} "
               f"(hang_timeout_s={self.timeout_s:g}); every thread's stack follows, and is in "
               f"{stacks_path(self.logs, self.rank)}")
        print(msg, file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception), open(stacks_path(self.logs, self.rank), "w") as f:
            f.write(msg + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        report = {"rank": self.rank, "phase": phase, "step": step, "idle_s": round(idle, 1),
                  "timeout_s": self.timeout_s, "suspect": suspect(self.logs)}
        with contextlib.suppress(OSError):
            _write(hang_report_path(self.logs, self.rank), report)
        sys.stderr.flush()
        self._end(HUNG_EXIT_CODE)


def suspect(logs: Path) -> dict | None:
    """The component's rank whose last progress is oldest (its heartbeat), with its phase; only
    heartbeats of this start of the job count (an earlier start's ranks are gone)."""
    beats = []
    for path in Path(logs).glob("heartbeat_rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            beat = json.loads(path.read_text())
            if beat.get("start", "") == current_start():
                beats.append(beat)
    if not beats:
        return None
    now = time.time()
    # A live watchdog rewrites its heartbeat every poll_s: three polls missed means the process
    # does not run (stopped, or stuck where even its watchdog thread cannot write).
    stopped = [b for b in beats if now - b.get("alive", now) > 3 * b.get("poll_s", HEARTBEAT_EVERY_S) + 1.0]
    chosen = min(stopped or beats, key=lambda b: (b["time"], b["rank"]))
    return {"rank": chosen["rank"], "phase": chosen.get("phase"), "step": chosen.get("step"),
            "stopped": bool(stopped)}


def read_hang_reports(logs: Path) -> list[dict]:
    """The hang reports of a component's ranks whose watchdog fired, by rank."""
    out = []
    for path in sorted(Path(logs).glob("hang_rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return sorted(out, key=lambda r: r.get("rank", 0))


def _write(path: Path, data: dict) -> None:
    # Not rundir.write_atomic's fsync: a heartbeat is rewritten every second, and a torn one is
    # only skipped by its reader. The rename keeps readers from seeing half a file.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
