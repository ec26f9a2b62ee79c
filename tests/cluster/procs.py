"""Process helpers for the test cluster: start daemons we track by PID, stop them by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def start_daemon(argv: list[str], log: Path, env: dict[str, str], **popen_kw) -> subprocess.Popen:
    """Start a foreground daemon in its own session, stdout/stderr appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, **popen_kw,
        )


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _reap(pid: int) -> None:
    # Our own children become zombies until waited for.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def terminate(pids: list[int], timeout: float = 10.0) -> list[int]:
    """SIGTERM `pids`, wait up to `timeout`, SIGKILL the rest. Returns the PIDs that needed SIGKILL."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    killed = [p for p in pids if alive(p)]
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    for pid in killed:
        _reap(pid)
    return killed


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def find_processes(comm_prefix: str, environ_marker: str | None = None) -> list[int]:
    """PIDs whose command name starts with `comm_prefix` (and whose environment holds
    `environ_marker`, e.g. ``SLURM_CONF=/path``, when given): how leftover slurmstepd of
    THIS cluster are found once their slurmd is gone."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if not comm.startswith(comm_prefix):
                continue
            if environ_marker is not None:
                env = (entry / "environ").read_bytes().split(b"\0")
                if environ_marker.encode() not in env:
                    continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if alive(int(entry.name)):  # zombies wait for a reaper, they run nothing
            found.append(int(entry.name))
    return found
