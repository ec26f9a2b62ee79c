"""What `slurm-align status` tells about a run: state, requeues, last checkpoint, and for a failed
job which component failed first, on which rank, with the last lines of that rank's log.

The job script records the first failing component (logs/first_failure) and keeps srun's or
mpirun's own messages in logs/<component>/launcher.log, where they name the rank that died.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from slurm_align.config.components import component_kinds, leader
from slurm_align.profiling.watchdog import read_hang_reports, stacks_path
from slurm_align.rundir import RunDir
from slurm_align.slurm import state as job_state

# srun: "srun: error: n2: task 1: Killed" / "... task 0: Exited with exit code 1"
_SRUN_TASK = re.compile(r"srun: error: \S+: tasks? (\d+)(?:-\d+)?: (.+)")
# mpirun: "mpirun noticed that process rank 1 with PID 42 on node x exited on signal 9 (Killed)."
_MPIRUN_RANK = re.compile(r"process rank (\d+) with PID \d+ on node \S+ (exited on signal.+|exited with.+)")
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\)", re.M)
# A rank that failed only because a peer died (gloo/NCCL saw its connection go, the rollout
# stream from the generator closed, the critic's server went, hung or answered a request with
# an error, as it does when one of its own ranks died mid-collective): a consequence.
# Each component kind adds what its clients log when it went away (ComponentKind.lost_peer).
_LOST_PEER = r"Connection (?:reset|closed) by peer|remote process exited"


def _lost_peer_pattern() -> re.Pattern[str]:
    return re.compile("|".join([_LOST_PEER] + [k.lost_peer for k in component_kinds() if k.lost_peer]))
# srun's teardown of a step (the job script's kill of the other components after one failed,
# or --kill-on-bad-exit): a task srun names after one of these ended because of it.
_TEARDOWN = re.compile(r"srun: forcing job termination|srun: Job step aborted|\*\*\* STEP \S+ ON \S+ CANCELLED")
_ITER = re.compile(r"^iter_(\d+)$")
RESTARTS = "restarts.jsonl"
"""Restart-on-failure decisions, one JSON line each (slurm/restart.py writes them)."""


def latest_step(root: Path) -> int | None:
    """Step of the newest complete checkpoint (a manifest.json, as models.checkpoint writes last);
    read here without importing torch and megatron, which `status` does not need."""
    steps = [int(m.group(1)) for p in root.glob("iter_*")
             if (m := _ITER.match(p.name)) and (p / "manifest.json").is_file()]
    return max(steps) if steps else None


@dataclass
class FailedRank:
    component: str
    rank: int | None
    why: str
    log: Path | None
    tail: list[str] = field(default_factory=list)
    torn_down: bool = False
    """srun named the rank only after it began tearing the step down: its end is a consequence."""
    lost_peer: bool = False
    """Its log ends in an error about a peer's lost connection: its end is a consequence."""


@dataclass
class RunStatus:
    job_id: str
    state: str
    components: dict[str, str]
    requeues: int
    last_checkpoint_step: int | None
    stopped_at_step: int | None = None
    pending_reasons: list[str] = field(default_factory=list)
    failed: FailedRank | None = None
    restarts: list[dict] = field(default_factory=list)
    """Restart-on-failure decisions (RUN_DIR/restarts.jsonl, slurm/restart.py), oldest first."""

    def to_dict(self) -> dict:
        out = {"job_id": self.job_id, "state": self.state, "components": self.components,
               "requeues": self.requeues, "restarts": self.restarts, "last_checkpoint_step": self.last_checkpoint_step,
               "stopped_at_step": self.stopped_at_step, "pending_reasons": self.pending_reasons, "failed": None}
        if self.failed is not None:
            f = self.failed
            out["failed"] = {"component": f.component, "rank": f.rank, "why": f.why,
                             "log": None if f.log is None else str(f.log), "tail": f.tail}
        return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []


def failing_rank(rd: RunDir, component: str, lines: int = 20) -> FailedRank:
    """The rank of `component` that failed: the node its pre-flight failed on (no rank started),
    else named by srun/mpirun in launcher.log (the first one named that did not fail only for a
    lost peer), else the rank whose log holds a Python traceback, else rank 0."""
    preflight = rd.logs / component / "preflight.log"
    if preflight.is_file():
        failed = [line for line in preflight.read_text(errors="replace").splitlines() if "pre-flight failed" in line]
        if failed:
            return FailedRank(component, None, failed[0].removeprefix("slurm-align "), preflight, failed[:lines],
                              lost_peer=_lost_peer(preflight))
    hangs = read_hang_reports(rd.logs / component)
    if hangs:   # a watchdog ended the job: name the rank that stopped first, and its phase
        first = hangs[0]
        sus = first.get("suspect") or first
        hung_rank = int(sus["rank"])
        where = f"in phase {sus['phase']} of step {sus['step']}" if sus.get("phase") else "outside any traced phase"
        how = "its process had stopped running" if sus.get("stopped") else "the rank that progressed last"
        why = (f"hung: no progress {where} ({how}; rank {first['rank']}'s watchdog fired after {first['idle_s']:g} s, "
               f"hang_timeout_s={first['timeout_s']:g}); stacks in {stacks_path(rd.logs / component, first['rank'])}")
        fired_log = rd.log(component, first["rank"])
        return FailedRank(component, hung_rank, why, fired_log, tail(fired_log, lines))
    launcher = rd.logs / component / "launcher.log"
    text = launcher.read_text(errors="replace") if launcher.is_file() else ""
    rank, why, torn_down, lost_peer = None, "", False, None
    teardown = _TEARDOWN.search(text)
    for pattern in (_SRUN_TASK, _MPIRUN_RANK):
        named = [(int(m.group(1)), m.group(2).strip().rstrip("."),
                  teardown is not None and m.start() > teardown.start())
                 for m in pattern.finditer(text)]
        if named:
            # The launcher lists ranks in the order their ends reached it, which races: a rank
            # that only lost its peer can be listed before the one that died. Skip those.
            chosen = next((n for n in named if not _lost_peer(rd.log(component, n[0]))), None)
            (rank, why, torn_down), lost_peer = (named[0], True) if chosen is None else (chosen, False)
            break
    logs = sorted((rd.logs / component).glob("rank*.log"), key=lambda p: int(p.stem[4:] or 0))
    if rank is None:
        with_trace = [p for p in logs if _TRACEBACK.search(p.read_text(errors="replace"))]
        if with_trace:
            rank, why = int(with_trace[0].stem[4:]), "Python exception"
        elif logs:
            rank, why = int(logs[0].stem[4:]), "unknown (see the launcher's log)"
    log = rd.log(component, rank) if rank is not None else None
    if lost_peer is None:
        lost_peer = log is not None and _lost_peer(log)
    return FailedRank(component, rank, why, log, tail(log, lines) if log else [], torn_down, lost_peer)


def _lost_peer(log: Path) -> bool:
    """Whether the rank's log ends in an error about a peer's lost connection."""
    text = "\n".join(tail(log, 60))
    return bool(_TRACEBACK.search(text) and _lost_peer_pattern().search(text))


def run_status(job) -> RunStatus:
    """`job`: a slurm_align.slurm.launch.Job."""
    rd = job.run_dir
    comps = job.component_states()
    state = job_state.combine(list(comps.values()))
    status = RunStatus(job.job_id, state, comps, _read_int(rd.requeue_count) or 0,
                       latest_step(rd.checkpoints(leader().name)), _read_int(rd.stopped_step))
    status.restarts = read_restarts(rd)
    if job.record.backend == "slurm" and state == job_state.PENDING:
        status.pending_reasons = job_state.pending_reasons(job.job_id)
    if state == job_state.FAILED:
        failed = [c for c, s in comps.items() if s == job_state.FAILED]
        status.failed = first_failure(rd, rd.first_failed_component(), failed)
    return status


def read_restarts(rd: RunDir) -> list[dict]:
    try:
        text = (rd.root / RESTARTS).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def first_failure(rd: RunDir, first: str | None, failed: list[str]) -> FailedRank | None:
    """The failure to report: the failing rank of the component the job script saw end first
    (`first`), unless that rank only lost its peer, or was killed by srun's teardown of the job,
    and another failed component's rank was not. The script reaps components as they end, and
    one whose peer died (the actor reading the generator's stream) can end before the component
    of the rank that died; the teardown then kills the others (a critic rank)."""
    order = ([first] if first else []) + [c for c in failed if c != first]
    ranks = [failing_rank(rd, c) for c in order]
    if not ranks:
        return None
    return next((f for f in ranks if not f.lost_peer and not f.torn_down),
                next((f for f in ranks if not f.lost_peer), ranks[0]))
