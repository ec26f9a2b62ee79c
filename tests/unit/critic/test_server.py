"""slurm_align/critic/server.py's port choice and its search for the stubs a dead tritonserver left
(the server itself runs in tests/integration/test_critic*.py)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time

import psutil
import pytest

from slurm_align.critic import server
from slurm_align.critic.server import CriticBindError, ephemeral_ports, pick_port


def test_a_free_port_is_picked_below_the_ephemeral_range_and_is_bindable():
    """Port 0 gives a port no port-0 listener or outgoing connection can take before Triton
    binds it (CI: a Triton start lost its port that way and the critic failed after 60 s)."""
    ephemeral = ephemeral_ports()
    for _ in range(20):
        port = pick_port("127.0.0.1", 0)
        assert 1024 <= port < ephemeral.start, (port, ephemeral)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_candidate_is_skipped():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = pick_port("127.0.0.1", 0)

        class Order(random.Random):
            def sample(self, population, k):   # the taken port first, then a free one
                return [busy, free]

        assert pick_port("127.0.0.1", 0, rng=Order()) == free


def test_with_no_room_below_the_range_the_kernel_picks(monkeypatch):
    kernels = ephemeral_ports()
    monkeypatch.setattr(server, "ephemeral_ports", lambda: range(1024, 65536))
    assert pick_port("127.0.0.1", 0) in kernels


def test_a_fixed_port_that_is_taken_names_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(CriticBindError, match=rf"127\.0\.0\.1:{busy}.*critic_server\.port to 0"):
            pick_port("127.0.0.1", busy)
        assert pick_port("127.0.0.1", 0) != busy


def _orphaned_stub(folder, mark: str) -> int:
    """The pid of a real process named as Triton's Python backend stub (a copy of bash, waiting
    in its `read` builtin on a FIFO no one writes: it forks nothing, as a `sleep` child would,
    whose fork is for a moment a second process of the same name and arguments), its arguments
    naming a shared-memory region as PyTriton's stubs do, and orphaned as a dead tritonserver
    leaves its stubs (the shell that started it exits)."""
    exe, fifo = folder / server.STUB, folder / "fifo"
    shutil.copy(shutil.which("bash"), exe)
    os.mkfifo(fifo)
    out = subprocess.run(["sh", "-c", f'setsid "{exe}" -c \'read -t 300 <> "$0"\' "{fifo}" {mark}0123abcd-region '
                                      '>/dev/null 2>&1 & echo $!'], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_the_stubs_a_dead_tritonserver_left_are_found_and_no_others(tmp_path):
    """A stub whose tritonserver died is reparented out of the critic's process tree; found by
    the shared-memory mark PyTriton gives it, the critic's own pid (another process's are not)."""
    ours = _orphaned_stub(tmp_path, f"{server.SHM_MARK}{os.getpid()}-")
    (tmp_path / "other").mkdir()
    other = _orphaned_stub(tmp_path / "other", f"{server.SHM_MARK}{os.getpid() + 1}-")
    try:
        assert ours not in {p.pid for p in psutil.Process().children(recursive=True)}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not server.stubs_of_this_process():
            time.sleep(0.05)   # until exec has replaced the forked shell
        assert [p.pid for p in server.stubs_of_this_process()] == [ours]
    finally:
        for pid in (ours, other):   # each leads its own session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
