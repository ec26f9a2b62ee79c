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
- processes: the program is the first process (init) of a PID namespace of its own (root makes
  it directly, a normal user inside its user namespace); when it ends or is killed, the kernel
  kills every process it started, those that left its process group with setsid() included,
  and the run returns only once they are gone (result.pid_namespace).
- /tmp and /dev/shm: fresh tmpfs mounts (SandboxLimits.tmp_bytes each) in the sandbox's mount
  namespace, so nothing it writes there stays after the run, and it sees nothing the node keeps
  there (result.private_tmp); the working directory is bound back at its path inside them.
  Where the kernel gives neither namespace the run goes ahead without and says so in the result,
  or, with `require_containment`, is refused (exit code 125).
- what is NOT confined: programs of sandboxes running at once as the same uid can signal each
  other's processes (a PID namespace hides its processes from the others, but not the others
  from it: the node's /proc stays mounted); other world-writable directories (/var/tmp) keep
  what is written there (each file under the size limit).
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
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, SIGKILL = 1, 9
status = {"network_isolated": False, "user_namespace": False, "hidden": [], "uid": os.getuid(),
          "pid_namespace": False, "private_tmp": False}
own_mounts = False

def fail(msg):
    os.write(2, ("sandbox: " + msg + "\n").encode())
    os._exit(125)

def own_mount_namespace():
    # private mounts (nothing propagates back to the node); then the hidden paths are covered and
    # /tmp and /dev/shm are fresh, so that nothing the program writes there outlives the namespace
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        fail(f"cannot make the mounts private: errno {ctypes.get_errno()}")
    hide(cfg["hidden_paths"])
    cwd = os.getcwd()
    keep = os.open(cwd, os.O_RDONLY)   # the working directory, reached below when /tmp is covered
    fresh = [libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                        f"size={cfg['tmp_bytes']},mode=1777".encode()) == 0
             for d in ("/tmp", "/dev/shm") if os.path.isdir(d)]
    status["private_tmp"] = bool(fresh) and all(fresh)
    if not os.path.isdir(cwd):   # it was under /tmp: the same path, bound into the fresh /tmp
        os.makedirs(cwd)
        if libc.mount(f"/proc/self/fd/{keep}".encode(), cwd.encode(), None, MS_BIND, None) != 0:
            fail(f"cannot bind the working directory {cwd} into the private /tmp: errno {ctypes.get_errno()}")
        os.chdir(cwd)
    os.close(keep)

def hide(paths):
    # an empty read-only tmpfs over each directory and /dev/null over each file
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
    status["pid_namespace"] = libc.unshare(CLONE_NEWPID) == 0   # for the program, forked below
    if libc.unshare(CLONE_NEWNS) == 0:
        own_mount_namespace()
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
# user also gets the network, mount and PID namespaces through it
flags = CLONE_NEWUSER | (0 if status["network_isolated"] else CLONE_NEWNET) | \
    (0 if own_mounts else CLONE_NEWNS) | (0 if status["pid_namespace"] else CLONE_NEWPID)
if libc.unshare(flags) == 0:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    status["user_namespace"] = status["network_isolated"] = status["pid_namespace"] = True
    if flags & CLONE_NEWNS:
        own_mount_namespace()
        own_mounts = True
if cfg["hidden_paths"] and not own_mounts:
    fail(f"cannot hide {cfg['hidden_paths']}: no mount namespace could be made (errno {ctypes.get_errno()})")
if cfg["require_network_isolation"] and not status["network_isolated"]:
    fail("no network namespace could be made and require_network_isolation is set")
if cfg["require_containment"] and not (status["pid_namespace"] and status["private_tmp"]):
    fail(f"require_containment is set, but the kernel gave no {'PID namespace' if not status['pid_namespace'] else ''}"
         f"{' and no ' if not status['pid_namespace'] and not status['private_tmp'] else ''}"
         f"{'private /tmp and /dev/shm' if not status['private_tmp'] else ''}")

for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), tuple(value))
python = next((p for p in cfg["pythons"] if os.access(p, os.X_OK)), None)
if python is None:
    fail(f"none of {cfg['pythons']} is executable by uid {uid}")
status["python"] = python

def report():
    os.write(cfg["status_fd"], json.dumps(status).encode())
    os.close(cfg["status_fd"])

if status["pid_namespace"]:
    # The program is the namespace's first process (its init): when it ends, the kernel kills
    # every process left in the namespace, setsid() or not, and it is not gone (a zombie or
    # reaped) before they all are. This process waits for it and passes its status on; killed
    # (the timeout kills this process group), it takes the program with it (PR_SET_PDEATHSIG);
    # the caller also kills the program by its pid (init_pid) and waits for it to be gone.
    parent = os.getpid()
    alive_r, alive_w = os.pipe()   # EOF on alive_r once this process is gone
    child = os.fork()
    if child:
        os.close(alive_r)
        status["init_pid"] = child
        report()
        _, st = os.waitpid(child, 0)
        if os.WIFSIGNALED(st):   # the same death (no imports here: the stdlib may be out of reach)
            os.kill(parent, os.WTERMSIG(st))
            os._exit(128 + os.WTERMSIG(st))   # a signal this process ignores (SIGPIPE, SIGINT)
        os._exit(os.waitstatus_to_exitcode(st))
    os.close(alive_w)
    os.close(cfg["status_fd"])
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    os.set_blocking(alive_r, False)
    try:
        os.read(alive_r, 1)
        os._exit(137)   # EOF: the parent died before the prctl above (getppid() is 0 in the namespace)
    except BlockingIOError:
        pass            # the parent lives (it holds the pipe open)
    os.close(alive_r)
else:
    report()
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
    tmp_bytes: int = 64 << 20
    """Size of the program's private /tmp and of its /dev/shm (each a fresh tmpfs)."""
    require_containment: bool = False
    """Refuse to run (exit code 125) where the kernel gives no PID namespace (so that no process
    of the program outlives it) or no private /tmp and /dev/shm (so that it leaves no files)."""


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
    pid_namespace: bool = False
    """The program ran as the first process of a PID namespace: none of its processes outlived it."""
    private_tmp: bool = False
    """/tmp and /dev/shm were fresh tmpfs mounts of its own: nothing it wrote there stayed."""
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


def _running(pid: int) -> bool:
    """Whether `pid` is alive: not gone and not a zombie (a PID namespace's init turns zombie
    only once every process of its namespace is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _end_namespace(init_pid: int | None, grace_s: float = 10.0) -> None:
    """Kill the program's PID namespace (by its init: a program that called setsid() is out of
    the process group) and wait until the kernel has taken every process of it."""
    if init_pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if _running(init_pid):
            os.kill(init_pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while _running(init_pid) and time.monotonic() < deadline:
        time.sleep(0.005)


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
           "require_containment": limits.require_containment, "tmp_bytes": limits.tmp_bytes,
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
    with contextlib.suppress(BlockingIOError):   # a status that came with the program's end
        streams[status_r] += os.read(status_r, 1 << 16)
    os.close(status_r)
    try:
        status = json.loads(streams[status_r].decode() or "{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        status = {}
    _end_namespace(status.get("init_pid"))
    out, err = bytes(streams[out_fd]), bytes(streams[err_fd])
    return SandboxResult(
        stdout=out.decode("utf-8", "replace"), stderr=err.decode("utf-8", "replace"), exit_code=exit_code,
        timed_out=timed_out, output_truncated=truncated, network_isolated=bool(status.get("network_isolated")),
        process_limit_scope="namespace" if status.get("user_namespace") else "uid", uid=status.get("uid"),
        python=status.get("python"),
        hidden_paths=status.get("hidden", []), pid_namespace=bool(status.get("pid_namespace")),
        private_tmp=bool(status.get("private_tmp")), wall_s=round(time.monotonic() - start, 3))


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
