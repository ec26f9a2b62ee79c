"""The sandbox that runs model-written Python: every case contained, the test process unharmed.

Each case runs a real program in the real sandbox (subprocess, rlimits, namespaces) with small
limits, so every test ends in about a second; none relies on timing (timeouts are ceilings).
As root (this machine) the program runs as `nobody` in user and network namespaces of its own;
test_unprivileged_caller runs the CLI as a normal user to cover that path too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.environments.sandbox import SandboxLimits, run_code
from slurm_align.rundir import RunDir, create_run_secret

FAST = SandboxLimits(timeout_s=20.0, cpu_s=5, processes=8)
OUTSIDE_TMP = "/var/tmp"
"""Where tests put files the program should see or not: the node's /tmp is out of its sight (its
/tmp is a fresh tmpfs of its own)."""
IS_ROOT = os.getuid() == 0


@pytest.fixture
def open_dir():
    """A temporary directory others may traverse (pytest's tmp_path is 0700, shut to `nobody`)."""
    d = Path(tempfile.mkdtemp(prefix="sandbox-test-", dir=OUTSIDE_TMP))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def survivors(marker: str) -> list[int]:
    """Pids of processes whose command line mentions `marker` (the sandbox's working dir)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_runs_in_a_fresh_directory_with_a_clean_environment(monkeypatch):
    monkeypatch.setenv("SLURM_ALIGN_TEST_SECRET", "s3cret")
    r = run_code("import os, sys\nprint(os.getcwd()); print(sorted(os.environ)); print(os.listdir('.'))\n"
                 "sys.stderr.write('to stderr')\nraise SystemExit(7)", FAST)
    cwd, env, listing = r.stdout.splitlines()
    assert r.exit_code == 7 and not r.timed_out and r.stderr == "to stderr"
    assert "slurm-align-sandbox-" in cwd and listing == "['main.py']" and not Path(cwd).exists()  # removed after
    assert "SLURM_ALIGN_TEST_SECRET" not in env and "s3cret" not in r.stdout
    if IS_ROOT:
        assert r.uid != 0 and r.uid is not None       # dropped to an unprivileged user


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    # 5 s: the program must print its working directory (the marker of its processes) before the
    # timeout, and on a loaded 2-core host its start took over 1 s (CI: nothing printed, and the
    # empty marker matched every process on the machine).
    r = run_code("import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    pass", SandboxLimits(timeout_s=5.0))
    assert r.timed_out and r.exit_code == -signal.SIGKILL
    marker = r.stdout.strip()
    assert "slurm-align-sandbox-" in marker, f"the program printed no working directory before the timeout: {r}"
    assert survivors(marker) == []


def test_cpu_time_limit():
    r = run_code("while True:\n    pass", SandboxLimits(timeout_s=30.0, cpu_s=1))
    assert not r.timed_out and r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)


def test_fork_bomb_hits_the_process_limit():
    code = ("import os\nprint(os.getcwd(), flush=True)\n"
            "while True:\n"
            "    try:\n        os.fork()\n"
            "    except OSError as e:\n"
            # one write(2) per line: under `python -u` print() writes 'refused', ' 11' and
            # the newline apart, and the bomb's processes interleave them
            "        os.write(1, b'refused %d\\n' % e.errno)\n        break\n")
    r = run_code(code, SandboxLimits(timeout_s=20.0, processes=8))
    lines = r.stdout.splitlines()
    assert "refused 11" in lines                        # EAGAIN: RLIMIT_NPROC
    assert survivors(lines[0]) == []                    # the whole group is gone afterwards
    if r.network_isolated and IS_ROOT:
        assert r.process_limit_scope == "namespace"     # counted in the sandbox's own user namespace


def test_bounded_forks_stay_under_the_limit():
    code = ("import os, time\nn = 0\n"
            "for _ in range(100):\n"
            "    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n"
            "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
            "    n += 1\n"
            "print(n, os.getcwd())\n")
    r = run_code(code, SandboxLimits(timeout_s=20.0, processes=6))
    n, cwd = r.stdout.split()
    assert 0 < int(n) < 6 and not r.timed_out          # the sleeping children did not hold it up
    assert survivors(cwd) == []


def test_allocating_10_gb_fails_with_memory_error():
    r = run_code("x = bytearray(10 * 2**30)\nprint('allocated')", FAST)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_writing_a_1_gb_file_stops_at_the_file_size_limit():
    code = ("import os\nchunk = b'x' * 2**20\n"
            "try:\n"
            "    with open('big', 'wb') as f:\n"
            "        for _ in range(1024):\n            f.write(chunk)\n"
            "except OSError as e:\n    print('errno', e.errno)\n"
            "print(os.path.getsize('big'))\n")
    limits = SandboxLimits(timeout_s=20.0, file_bytes=4 << 20)
    r = run_code(code, limits)
    errno_line, size = r.stdout.splitlines()
    assert errno_line == "errno 27" and int(size) <= limits.file_bytes     # EFBIG


def test_files_outside_its_directory(open_dir: Path):
    # documented: world-readable files (here /etc/passwd) can be read; the run's secret cannot
    rd = RunDir(open_dir / "run")
    rd.root.mkdir(mode=0o755)
    create_run_secret(rd)
    (rd.root / "notes.txt").write_text("world readable")
    os.chmod(rd.root / "notes.txt", 0o644)
    code = (f"print(open('/etc/passwd').read().startswith('root:'))\n"
            f"for p in [{str(rd.secret)!r}, {str(rd.root / 'notes.txt')!r}]:\n"
            f"    try:\n        print(repr(open(p).read()))\n"
            f"    except OSError as e:\n        print(type(e).__name__)\n")
    secret = rd.secret.read_text()
    if IS_ROOT:
        r = run_code(code, FAST)
        assert r.stdout.splitlines() == ["True", "PermissionError", "'world readable'"] and secret not in r.stdout
    # hidden_paths: the run directory is not there at all (a normal user's sandbox needs this);
    # a hidden file reads as empty
    other = open_dir / "other.txt"
    other.write_text("also readable")
    os.chmod(other, 0o644)
    code += f"print(repr(open({str(other)!r}).read()))\n"
    r = run_code(code, SandboxLimits(timeout_s=20.0, hidden_paths=(str(rd.root), str(other))))
    if r.exit_code == 125 and "cannot hide" in r.stderr:
        pytest.skip(f"no mount namespace here: hidden_paths cannot be honoured, the run is refused ({r.stderr})")
    assert r.hidden_paths == [str(rd.root), str(other)]
    assert r.stdout.splitlines() == ["True", "FileNotFoundError", "FileNotFoundError", "''"]
    assert secret not in r.stdout and other.read_text() == "also readable"     # the node's files untouched


def test_network_socket_to_a_loopback_listener_is_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                f"    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)\n")
        r = run_code(code, FAST)
        if not r.network_isolated:
            pytest.skip("the kernel allows no network namespace here: the sandbox has the node's network "
                        "(documented in sandbox.py; require_network_isolation refuses to run instead)")
        assert r.stdout.startswith("refused") and "connected" not in r.stdout
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):             # nothing ever reached the listener
            listener.accept()


def test_printing_100_mb_is_cut_at_the_output_cap():
    limits = SandboxLimits(timeout_s=20.0, output_bytes=64 << 10)
    r = run_code("import sys\nsys.stdout.write('x' * (100 * 2**20))\nsys.stdout.flush()\nprint('end')", limits)
    assert r.output_truncated and len(r.stdout) == limits.output_bytes and set(r.stdout) == {"x"}
    assert r.exit_code == -signal.SIGKILL and not r.timed_out
    r = run_code("import sys\nsys.stderr.write('e' * (10 * 2**20))", limits)
    assert r.output_truncated and len(r.stderr) == limits.output_bytes


def test_background_children_do_not_outlive_the_program():
    marker = f"{os.getpid()}{time.time_ns() % 10**6}"      # seconds of sleep no other process uses
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('started')"
    r = run_code(code, FAST)
    assert r.stdout == "started\n" and r.exit_code == 0
    assert not r.timed_out                              # returned when the program ended, not at 20 s
    assert survivors(marker) == []                      # and its child went with it


def test_a_new_session_and_a_double_forked_grandchild_do_not_outlive_the_program():
    """setsid() leaves the process group the timeout kills: the PID namespace takes them anyway,
    when the program ends and when it is killed at its timeout."""
    marker = f"{os.getpid()}{time.time_ns() % 10**6 + 1}"
    code = (f"import os, subprocess, sys\n"
            f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
            f"if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execvp('sleep', ['sleep', '{marker}1'])\n    os._exit(0)\n"
            f"print(os.getpid())\n")
    r = run_code(code, FAST)
    assert r.pid_namespace, r
    assert r.exit_code == 0 and r.stdout == "1\n", r       # the program is its namespace's first process
    assert not r.timed_out                                 # the detached sleepers held no pipe open
    assert survivors(marker) == []
    r = run_code(code.replace("print(os.getpid())\n", "while True:\n    pass\n"),
                 SandboxLimits(timeout_s=2.0, cpu_s=5, processes=8))
    assert r.timed_out and survivors(marker) == []


def test_files_written_to_tmp_and_dev_shm_are_gone_after_the_run():
    marker = f"sandbox-left-{os.getpid()}-{time.time_ns()}"
    code = (f"import os\nfor d in ('/tmp', '/dev/shm'):\n"
            f"    open(os.path.join(d, '{marker}'), 'w').write('x')\n"
            f"    print(os.path.exists(os.path.join(d, '{marker}')))\n")
    r = run_code(code, FAST)
    assert r.stdout == "True\nTrue\n" and r.exit_code == 0, r    # it could write there
    assert r.private_tmp
    assert not Path("/tmp", marker).exists() and not Path("/dev/shm", marker).exists()


def test_containment_can_be_required():
    r = run_code("print('ran')", SandboxLimits(timeout_s=20.0, cpu_s=5, processes=8, require_containment=True))
    # here the kernel gives both, so it runs; where it cannot, the bootstrap refuses with 125
    assert (r.stdout, r.exit_code, r.pid_namespace, r.private_tmp) == ("ran\n", 0, True, True), r


def test_cli_prints_json():
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("print('hi')\nwhile True:\n    pass\n")
    try:
        out = subprocess.run([sys.executable, "-m", "slurm_align.environments.sandbox", "--timeout-s", "1", f.name],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    finally:
        os.unlink(f.name)
    result = json.loads(out)
    assert result["stdout"] == "hi\n" and result["timed_out"] is True and result["exit_code"] == -9
    assert {"stdout", "stderr", "exit_code", "timed_out"} <= set(result)
    bad = subprocess.run([sys.executable, "-m", "slurm_align.environments.sandbox", "--timeout-s", "0", "x.py"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--timeout-s must be positive" in bad.stderr


@pytest.mark.skipif(not IS_ROOT or not Path("/usr/bin/python3").exists(),
                    reason="needs root to start the CLI as another, normal user")
def test_unprivileged_caller(open_dir: Path):
    # a normal user (nobody, started so) runs the CLI: no privileges to drop, the namespaces
    # are made unprivileged; its own world-readable file is hidden by --hide, and a listener on
    # the node's loopback, which the program would reach with the node's network, is out of reach
    hidden = open_dir / "rundir"
    hidden.mkdir(mode=0o755)
    (hidden / "run.secret").write_text("top secret")
    os.chmod(hidden / "run.secret", 0o644)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        prog = open_dir / "prog.py"
        prog.write_text("import os, socket\nprint(os.getuid())\n"
                        f"print(os.path.exists({str(hidden / 'run.secret')!r}))\n"
                        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
                        "    print('connected')\n"
                        "except OSError as e:\n    print('refused', e.errno)\n")
        os.chmod(prog, 0o644)
        # the same connect outside the sandbox, as the same user, reaches the listener: the
        # refusal below is the sandbox's doing, not the port's
        reach = subprocess.run(["/usr/bin/python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', "
                                f"{port}), timeout=5); print('connected')"], user=65534, group=65534,
                               extra_groups=[], capture_output=True, text=True, timeout=60)
        assert reach.stdout == "connected\n", reach.stderr
        listener.settimeout(10)
        listener.accept()[0].close()
        out = subprocess.run(["/usr/bin/python3", "-m", "slurm_align.environments.sandbox", "--timeout-s", "20",
                              "--hide", str(hidden), str(prog)], cwd=REPO_ROOT, user=65534, group=65534,
                             extra_groups=[], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        if result["process_limit_scope"] != "namespace":
            pytest.skip(f"no unprivileged user namespace here: {result['stderr']}")
        lines = result["stdout"].splitlines()
        assert lines[0] == "65534" and lines[1] == "False" and lines[2].startswith("refused"), result
        assert result["network_isolated"] and result["hidden_paths"] == [str(hidden)]
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):             # nothing from the sandbox reached the listener
            listener.accept()
