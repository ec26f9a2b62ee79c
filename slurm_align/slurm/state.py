"""Job states without accounting: scontrol (kept for MinJobAge), then sacct where it works.

submitit's stock watcher asks sacct only; with accounting off it never sees a job die.
Here a hetjob's state is the combination of its components' states.
"""

from __future__ import annotations

import re
import shutil
import subprocess

PENDING = "PENDING"
RUNNING = "RUNNING"
COMPLETED = "COMPLETED"
FAILED = "FAILED"
CANCELLED = "CANCELLED"
STOPPED = "STOPPED"
"""Stopped at a checkpoint for preemption or the time limit, not requeued (resume it)."""
UNKNOWN = "UNKNOWN"

# Slurm states that mean the job is over, and how they fold into ours.
_FINAL = {
    "COMPLETED": COMPLETED, "FAILED": FAILED, "CANCELLED": CANCELLED, "TIMEOUT": FAILED,
    "NODE_FAIL": FAILED, "OUT_OF_MEMORY": FAILED, "BOOT_FAIL": FAILED, "DEADLINE": FAILED,
    "PREEMPTED": FAILED, "REVOKED": CANCELLED,
}
FINAL_STATES = (COMPLETED, FAILED, CANCELLED, STOPPED)


def fold(slurm_state: str) -> str:
    base = slurm_state.split()[0].rstrip("+") if slurm_state else UNKNOWN
    if base in _FINAL:
        return _FINAL[base]
    if base in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD",
                "SUSPENDED"):
        return PENDING
    if base in ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"):
        return RUNNING
    return UNKNOWN


def is_completing(slurm_state: str) -> bool:
    """Slurm is ending the job (cancel, time limit, failure): its final state is not out yet."""
    return bool(slurm_state) and slurm_state.split()[0].rstrip("+") == "COMPLETING"


def combine(states: list[str]) -> str:
    """A hetjob is FAILED if any component failed, COMPLETED only when all did."""
    if not states:
        return UNKNOWN
    for s in (FAILED, CANCELLED, STOPPED):
        if s in states:
            return s
    if all(s == COMPLETED for s in states):
        return COMPLETED
    if RUNNING in states or COMPLETED in states:
        return RUNNING
    if all(s == PENDING for s in states):
        return PENDING
    return UNKNOWN


def _scontrol_show(job_id: str) -> str | None:
    if not shutil.which("scontrol"):
        return None
    try:
        proc = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return proc.stdout if proc.returncode == 0 else None


def scontrol_states(job_id: str) -> list[str] | None:
    """Per-component Slurm states from `scontrol show job` (None when Slurm forgot the job)."""
    text = _scontrol_show(job_id)
    return (re.findall(r"\bJobState=(\S+)", text) or None) if text else None


def pending_reasons(job_id: str) -> list[str]:
    """Why Slurm keeps the job's components waiting (e.g. 'Resources', 'Priority',
    'BeginTime' after a requeue); empty when none waits."""
    text = _scontrol_show(job_id)
    if not text:
        return []
    return [reason for state, reason in re.findall(r"\bJobState=(\S+) Reason=(\S+)", text)
            if state == "PENDING" and reason != "None"]


def sacct_states(job_id: str) -> list[str] | None:
    if not shutil.which("sacct"):
        return None
    try:
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", str(job_id)],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    states = [line.split("|")[1] for line in proc.stdout.splitlines() if "|" in line]
    return states or None


def slurm_state(job_id: str) -> tuple[str, list[str]]:
    """(combined state, raw per-component states)."""
    raw = scontrol_states(job_id) or sacct_states(job_id)
    if raw is None:
        return UNKNOWN, []
    return combine([fold(s) for s in raw]), raw
