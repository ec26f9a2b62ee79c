"""Model-written Python run as hostile code: a subprocess in a fresh temporary directory with
CPU-time, address-space, file-size, process-count and open-file limits, no network where the
kernel allows it, a wall-clock timeout that kills its whole process group, and capped output.

    python -m slurm_align.environments.sandbox --timeout-s 5 prog.py
    {"stdout": "...", "stderr": "", "exit_code": 0, "timed_out": false, ...}

How the child is confined (a small bootstrap interpreter sets it up, then execs the program;
no preexec_fn, which is unsafe in a threaded process such as the tool pool):
- privileges: started as root (as tests here and some containers are), the child drops to an
  unprivileged user (SandboxLimits.user, default `nobody`) before running anything of the
  model's: RLIMIT_NPROC does not bind root, and root could read every file. Started as a normal
  user, the child stays that user.
- a user namespace of its own (unshare(CLONE_NEWUSER), unprivileged, with its uid mapped to
  itself): RLIMIT_NPROC then counts the sandbox's own processes only, not every process of the
  uid on the node (measured here, kernel 6.18: 4 forks allowed under a limit of 5 while six other
  `nobody` processes ran). Without it (kernel.unprivileged_userns_clone=0, AppArmor's userns
  restriction) the limit counts the uid's processes node-wide: result.process_limit_scope says
  which ("namespace" or "uid").
- network: a network namespace of its own with only a loopback that is down, so every connect
  fails (root makes it directly; a normal user makes it inside its user namespace). Where the
  kernel allows neither, the program has the node's network: result.network_isolated is False
  and `require_network_isolation` refuses to run it instead.
- files: the program can read what its uid may read (e.g. /etc/passwd; as `nobody`, nothing
  that is mode 0600, such as a run's run.secret). `hidden_paths` (the python tool passes the
  run directory: tools.PythonTool.for_run) are covered by an empty read-only tmpfs (a file: by
  /dev/null) in a mount namespace of the sandbox's own (root makes it directly, a normal user
  inside its user namespace; where neither can, the run is refused with exit code 125 rather
  than run unhidden). This matters most when the caller is a normal user, whose own files the
  sandbox's uid can otherwise read. The environment is replaced by a minimal one (no secrets
  from the caller's environment variables).
- what is NOT confined: a program that calls setsid() leaves the process group and outlives
  the wall-clock kill (it stays under the CPU-time, process and file limits); programs of
  sandboxes running at once as the same uid can signal each other's processes; files written
  into world-writable directories (/tmp, /dev/shm) stay after the run (each under the size
  limit; the working directory itself is removed). A PID namespace
  or a cgroup would close both; neither is used yet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Runs in the child as `python -I -S -c _BOOTSTRAP CONFIG_JSON`; reports what it achieved on the
# status pipe, then execs the program (it never runs the model's code itself).
_BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
status = {"network_isolated": False, "user_namespace": False, "hidden": [], "uid": os.getuid()}
own_mounts = False

def fail(msg):
    os.write(2, ("sandbox: " + msg + "\n").encode())
    os._exit(125)

def hide(paths):
    # private mounts (nothing propagates back to the node), then an empty read-only tmpfs over
    # each directory and /dev/null over each file
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        fail(f"cannot make the mounts private: errno {ctypes.get_errno()}")
    for p in paths:
        if os.path.isdir(p):
            ok = libc.mount(b"tmpfs", p.encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                            b"size=4k,mode=0555") == 0
        elif os.path.exists(p):
            ok = libc.mount(b"/dev/null", p.encode(), None, MS_BIND, None) == 0
        else:
            continue            # not there, or not reachable by this uid: nothing to hide
        if not ok:
            fail(f"cannot hide {p}: errno {ctypes.get_errno()}")
        status["hidden"].append(p)

if os.getuid() == 0:
    # root makes the network and mount namespaces itself (no user namespace needed for them),
    # then drops to the sandbox user before anything of the model's runs
    status["network_isolated"] = libc.unshare(CLONE_NEWNET) == 0
    if cfg["hidden_paths"] and libc.unshare(CLONE_NEWNS) == 0:
        hide(cfg["hidden_paths"])
        own_mounts = True
    try:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    except OSError as e:
        fail(f"cannot drop privileges to uid {cfg['uid']}: {e}")
    if 0 in os.getresuid() or 0 in os.getresgid():
        fail("still root after dropping privileges")
    libc.prctl(4, 1, 0, 0, 0)   # PR_SET_DUMPABLE: else /proc/self/*_map stay root's after setuid
uid, gid = os.getuid(), os.getgid()
status["uid"] = uid
# a user namespace of our own: RLIMIT_NPROC then counts this sandbox's processes alone; a normal
# user also gets the network and mount namespaces through it
flags = CLONE_NEWUSER | (0 if status["network_isolated"] else CLONE_NEWNET) | \
    (CLONE_NEWNS if cfg["hidden_paths"] and not own_mounts else 0)
if libc.unshare(flags) == 0:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    status["user_namespace"] = status["network_isolated"] = True
    if flags & CLONE_NEWNS:
        hide(cfg["hidden_paths"])
        own_mounts = True
if cfg["hidden_paths"] and not own_mounts:
    fail(f"cannot hide {cfg['hidden_paths']}: no mount namespace could be made (errno {ctypes.get_errno()})")
if cfg["require_network_isolation"] and not status["network_isolated"]:
    fail("no network namespace could be made and require_network_isolation is set")
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
python = next((p for p in cfg["pythons"] if os.access(p, os.X_OK)), None)
if python is None:
    fail(f"none of {cfg['pythons']} is executable by uid {uid}")
status["python"] = python
os.write(cfg["status_fd"], json.dumps(status).encode())
os.close(cfg["status_fd"])
os.execve(python, [python, "-I", "-u", cfg["file"]], cfg["env"])   # -u: output so far survives a kill
"""


FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (defaults sized for tool calls on a shared node)."""

    timeout_s: float = 10.0
    """Wall clock; then the process group is killed (result.timed_out)."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU: SIGXCPU at the limit, SIGKILL a second later)."""
    memory_bytes: int = 1 << 30
    """Address space (RLIMIT_AS); allocations past it fail with MemoryError."""
    file_bytes: int = 16 << 20
    """Largest file the program may write (RLIMIT_FSIZE; Python gets EFBIG past it)."""
    processes: int = 16
    """Processes and threads (RLIMIT_NPROC), the program itself included."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 64 << 10
    """Bytes kept of stdout and of stderr each; more kills the program (result.output_truncated)."""
    user: str | int = "nobody"
    """The unprivileged user (name or uid) a root caller's sandbox runs as."""
    python: str = sys.executable
    """The interpreter that runs the program; where the sandbox's user may not execute it (an
    interpreter under /root, say), the first of FALLBACK_PYTHONS that it may (result.python)."""
    hidden_paths: tuple[str, ...] = ()
    """Files and directories the program must not see (covered in its own mount namespace)."""
    require_network_isolation: bool = False
    """Refuse to run (exit code 125) where no network namespace can be made."""
    tmp_dir: str | None = None
    """Where the fresh working directory is made (default: the system's temporary directory)."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int
    """The program's exit status; -N when killed by signal N (-9 after a timeout or an output cap)."""
    timed_out: bool
    output_truncated: bool = False
    network_isolated: bool = False
    process_limit_scope: str = "uid"
    """'namespace': the process limit counts this sandbox's processes; 'uid': all of its uid's."""
    uid: int | None = None
    python: str | None = None
    """The interpreter that ran the program."""
    hidden_paths: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _ids(user: str | int) -> tuple[int, int]:
    entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    return {"RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1), "RLIMIT_AS": (limits.memory_bytes,) * 2,
            "RLIMIT_FSIZE": (limits.file_bytes,) * 2, "RLIMIT_NPROC": (limits.processes,) * 2,
            "RLIMIT_NOFILE": (limits.open_files,) * 2, "RLIMIT_CORE": (0, 0)}


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_file(path: str | Path, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run a Python file (copied into a fresh directory) in the sandbox."""
    return run_code(Path(path).read_text(encoding="utf-8", errors="replace"), limits)


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run Python source in the sandbox; never raises for anything the code does."""
    workdir = Path(tempfile.mkdtemp(prefix="slurm-align-sandbox-", dir=limits.tmp_dir))
    try:
        return _run(code, workdir, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, workdir: Path, limits: SandboxLimits) -> SandboxResult:
    main = workdir / "main.py"
    main.write_text(code, encoding="utf-8")
    uid, gid = _ids(limits.user) if os.getuid() == 0 else (os.getuid(), os.getgid())
    if os.getuid() == 0:
        for p in (workdir, main):
            os.chown(p, uid, gid)
    status_r, status_w = os.pipe()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
           "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cfg = {"uid": uid, "gid": gid, "pythons": [limits.python, *FALLBACK_PYTHONS], "file": str(main),
           "status_fd": status_w, "rlimits": _rlimits(limits),
           "hidden_paths": [os.path.abspath(p) for p in limits.hidden_paths],
           "require_network_isolation": limits.require_network_isolation,
           "env": env}
    start = time.monotonic()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                                cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True)
    finally:
        os.close(status_w)
    assert proc.stdout is not None and proc.stderr is not None, "both are PIPEs"
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    caps = {out_fd: limits.output_bytes, err_fd: limits.output_bytes, status_r: 1 << 16}
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not truncated:
            remaining = start + limits.timeout_s - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if proc.poll() is not None:
                # the program is done: whatever it left running in its group must not keep
                # the pipes open until the deadline
                _kill_group(proc.pid)
            for key, _ in sel.select(timeout=min(remaining, 0.1)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf, room = streams[key.fd], caps[key.fd] - len(streams[key.fd])
                buf += data[:room]
                truncated = truncated or len(data) > room
    _kill_group(proc.pid)
    exit_code = proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    os.close(status_r)
    try:
        status = json.loads(streams[status_r].decode() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        status = {}
    out, err = bytes(streams[out_fd]), bytes(streams[err_fd])
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"), exit_code=exit_code,
        timed_out=timed_out, output_truncated=truncated, network_isolated=bool(status.get("network_isolated")),
        process_limit_scope="namespace" if status.get("user_namespace") else "uid", uid=status.get("uid"),
        python=status.get("python"),
        hidden_paths=status.get("hidden", []), wall_s=round(time.monotonic() - start, 3))


def main(argv: list[str] | None = None) -> int:
    d = SandboxLimits()
    p = argparse.ArgumentParser(prog="python -m slurm_align.environments.sandbox",
                                description="Run one Python file in the sandbox; print the result as JSON.")
    p.add_argument("file", help="the Python file to run")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help=f"wall clock (default {d.timeout_s:g})")
    p.add_argument("--cpu-s", type=int, default=d.cpu_s, help=f"CPU seconds (default {d.cpu_s})")
    p.add_argument("--memory-mb", type=int, default=d.memory_bytes >> 20, help="address space in MiB")
    p.add_argument("--file-mb", type=int, default=d.file_bytes >> 20, help="largest file written, MiB")
    p.add_argument("--processes", type=int, default=d.processes, help="processes and threads")
    p.add_argument("--output-kb", type=int, default=d.output_bytes >> 10, help="KiB kept of stdout, of stderr")
    p.add_argument("--hide", action="append", default=[], help="a path the program must not see (repeatable)")
    p.add_argument("--require-network-isolation", action="store_true", help="refuse to run without it")
    a = p.parse_args(argv)
    if a.timeout_s <= 0:
        p.error(f"--timeout-s must be positive, got {a.timeout_s}")
    if not os.path.isfile(a.file):
        p.error(f"{a.file}: no such file")
    limits = SandboxLimits(timeout_s=a.timeout_s, cpu_s=a.cpu_s, memory_bytes=a.memory_mb << 20,
                           file_bytes=a.file_mb << 20, processes=a.processes, output_bytes=a.output_kb << 10,
                           hidden_paths=tuple(a.hide), require_network_isolation=a.require_network_isolation)
    print(json.dumps(asdict(run_file(a.file, limits))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
