"""The per-rank watchdog (profiling/watchdog.py) in-process, with a real Tracer and its thread:
only the process's end is caught (it would end the test run). The watchdog in a real job:
tests/integration/test_watchdog.py."""

from __future__ import annotations

import json
import threading
import time

from slurm_align.profiling.timers import Tracer
from slurm_align.profiling.watchdog import HUNG_EXIT_CODE, Watchdog, heartbeat_path, stacks_path
from slurm_align.rundir import RunDir
from slurm_align.slurm.status import failing_rank


class _Ended:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()


def test_a_rank_stuck_in_a_phase_dumps_its_stacks_and_status_names_the_stopped_peer(tmp_path):
    rd = RunDir(tmp_path)
    logs = rd.logs / "actor"
    logs.mkdir(parents=True)
    # Rank 1 stopped (SIGSTOP) in `generate`: its heartbeat's `alive` went stale long ago, though
    # its last progress is newer than rank 0's (rank 0 waits for it since it starts below).
    heartbeat_path(logs, 1).write_text(json.dumps({"rank": 1, "time": time.time() + 30, "phase": "generate",
                                                   "step": 3, "start": "", "alive": time.time() - 30, "poll_s": 0.05}))
    ended = _Ended()
    tracer = Tracer(tmp_path, "actor", 0)
    tracer.watchdog = Watchdog(0.5, logs, 0, poll_s=0.05, end=ended).start()
    with tracer.span("train", 3):
        assert ended.event.wait(60), "the watchdog never fired"   # a ceiling for a loaded machine
    assert ended.codes == [HUNG_EXIT_CODE]
    report = json.loads((logs / "hang_rank0.json").read_text())
    assert (report["rank"], report["phase"], report["step"]) == (0, "train", 3)
    assert report["suspect"] == {"rank": 1, "phase": "generate", "step": 3, "stopped": True}
    stacks = stacks_path(logs, 0).read_text()
    # every thread's stack, the stuck main thread's (in this test, inside the span) among them
    assert stacks.count("most recent call first") >= 2 and "test_a_rank_stuck_in_a_phase_dumps_its_stacks" in stacks
    failed = failing_rank(rd, "actor")
    assert failed.rank == 1 and "hung: no progress in phase generate of step 3" in failed.why
    assert "its process had stopped running" in failed.why and str(stacks_path(logs, 0)) in failed.why


def test_without_a_stopped_peer_the_suspect_is_the_rank_that_progressed_last(tmp_path):
    logs = tmp_path / "logs" / "actor"
    logs.mkdir(parents=True)
    ended = _Ended()
    dog = Watchdog(0.5, logs, 0, poll_s=0.05, end=ended).start()
    # Rank 2 is alive (blocked in a collective: its watchdog still beats) but progressed before rank 0.
    heartbeat_path(logs, 2).write_text(json.dumps({"rank": 2, "time": time.time() - 1, "phase": "rebalance",
                                                   "step": 7, "start": "", "alive": time.time() + 60, "poll_s": 0.05}))
    dog.enter("train", 7)
    assert ended.event.wait(60)
    report = json.loads((logs / "hang_rank0.json").read_text())
    assert report["suspect"] == {"rank": 2, "phase": "rebalance", "step": 7, "stopped": False}


def test_closed_spans_are_progress(tmp_path):
    logs = tmp_path / "logs" / "actor"
    ended = _Ended()
    tracer = Tracer(tmp_path, "actor", 0)
    tracer.watchdog = Watchdog(2.0, logs, 0, poll_s=0.05, end=ended).start()
    for step in range(40):   # 4 s of work, twice the timeout, in short phases
        with tracer.span("generate", step):
            time.sleep(0.1)
    tracer.watchdog.stop()
    assert ended.codes == [] and not (logs / "hang_rank0.json").exists()
    assert json.loads(heartbeat_path(logs, 0).read_text())["phase"] is None   # no phase open now
