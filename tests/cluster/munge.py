"""munged for the test cluster: reuse a running one, or start one we track by PID."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

from .procs import start_daemon

RUN_DIR = Path("/run/munge")
KEY = Path("/etc/munge/munge.key")
MUNGED = "/usr/sbin/munged"
# Clusters of two pytest workers start at once: without one lock around "is munged up? start it",
# both start one and the second dies on munged's own socket lock.
START_LOCK = Path("/tmp/sa-munged-start.lock")


def munge_works() -> bool:
    """True when a credential can be made and read back (munged is up and has a key)."""
    if shutil.which("munge") is None:
        return False
    made = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if made.returncode != 0:
        return False
    read = subprocess.run(["unmunge"], input=made.stdout, capture_output=True, timeout=10)
    return read.returncode == 0


def ensure_munged(log: Path, timeout: float = 10.0) -> subprocess.Popen | None:
    """Make sure munged answers. Returns the process we started, or None if one was running."""
    with open(START_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        return _ensure_munged(log, timeout)


def _ensure_munged(log: Path, timeout: float) -> subprocess.Popen | None:
    if munge_works():
        return None
    if not Path(MUNGED).exists():
        raise RuntimeError(f"{MUNGED} not found: install munge (bash .ci/setup.sh)")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(RUN_DIR, "munge", "munge")
    if not KEY.exists():
        # Debian's package creates the key; a machine that lost it gets a new one.
        subprocess.run(["mungekey", "--create", f"--keyfile={KEY}"], check=True)
        shutil.chown(KEY, "munge", "munge")
        os.chmod(KEY, 0o600)
    proc = start_daemon([MUNGED, "-F"], log, dict(os.environ),
                        user="munge", group="munge", extra_groups=[])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"munged exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        if munge_works():
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"munged did not answer within {timeout:.0f} s; see {log}:\n{_tail(log)}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
