"""A real Slurm cluster on this one host: munged, slurmctld and N slurmd (n1..nN).

Every daemon runs in the foreground (-D/-F) as a process we started and track by PID;
nothing goes through systemd, and nothing outside `workdir` is written except munged's
socket in /run/munge. Clients find the cluster through SLURM_CONF (see `env`).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from . import procs
from .munge import ensure_munged

TEMPLATE = Path(__file__).with_name("slurm.conf.template")
# Every slurmd here shares this host, which separate hosts would not:
# - /dev/shm and /tmp: OpenMPI names its shared-memory segments and session directory by host
#   name, job and local rank, so ranks of one job on two "nodes" map the same segment and crash in
#   MPI_Init or the first collective (measured: srun -N 4 -n 8 of an mpi4py allgather segfaulted 15
#   times in 15). A directory per node keeps them apart.
# - ob1's TCP BTL between "nodes" then still crashed in MPI_Init in 4 to 7 of 150 of those sruns (once
#   in a suite run too): a fragment reaching a rank before its PML registered the fragment's tag: a call
#   through a NULL callback in mca_btl_tcp, read from a core file. UCX, which OpenMPI also ships,
#   gave 0 crashes in 200. Real clusters pick their own transport; this one is the test cluster's.
# - its cores: every rank of every "node" runs on this host's few cores, so a rank that waits in
#   MPI yields its core (mpi_yield_when_idle, which mpirun sets itself when it oversubscribes;
#   srun does not) instead of spinning on it while other jobs' ranks compute.
# Each `export` line the TaskProlog prints lands in the task's environment.
TASK_PROLOG = """#!/bin/sh
echo "export OMPI_MCA_btl_vader_backing_directory={tmp}/$SLURMD_NODENAME"
echo "export OMPI_MCA_orte_tmpdir_base={tmp}/$SLURMD_NODENAME"
echo "export OMPI_MCA_pml=ucx"
echo "export OMPI_MCA_pml_ucx_tls=any"
echo "export OMPI_MCA_pml_ucx_devices=any"
echo "export OMPI_MCA_mpi_yield_when_idle=1"
"""
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
# Job states that mean "still holds or wants resources".
ACTIVE_STATES = "PENDING,RUNNING,SUSPENDED,COMPLETING,CONFIGURING,RESIZING,REQUEUED,SIGNALING,STAGE_OUT"


class ClusterError(RuntimeError):
    """The test cluster could not be started or stopped; the message holds the log tails."""


def slurm_installed() -> bool:
    """True when the Slurm daemons and client commands are on this machine."""
    return all(Path(p).exists() for p in (SLURMCTLD, SLURMD)) and shutil.which("sinfo") is not None


# Slurm's daemons cannot bind port 0 (slurm.conf names their ports), so the cluster picks them.
# Two rules keep that race-free: the block lies below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768.. here), so no port-0 bind or outgoing connection is ever
# given one of its ports; and clusters pick and bind under one host-wide lock (PORT_LOCK), so two
# clusters starting at once cannot pick the same free block.
PORT_LOCK = Path("/tmp/sa-cluster-ports.lock")


def _free_port_block(count: int, low: int = 20000, high: int = 32768) -> int:
    """First port of `count` consecutive ports that are free now (call it holding PORT_LOCK)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        if all(_port_free(base + i) for i in range(count)):
            return base
    raise ClusterError(f"no block of {count} free TCP ports in [{low}, {high})")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return f"--- {path}: (missing)"
    return f"--- {path} (last {len(text)} lines)\n" + "\n".join(text)


@dataclass
class LocalSlurmCluster:
    """munged + slurmctld + `n_nodes` slurmd on this host, partition `partition`.

    `start()` returns once `sinfo` shows every node idle; `stop()` cancels all jobs,
    waits for them to leave, then stops the daemons by PID (leftover slurmstepd too).
    """

    workdir: Path
    n_nodes: int = 4
    cpus_per_node: int = 2
    real_memory_mb: int = 2048
    partition: str = "debug"
    cluster_name: str = "slurmalign"
    hostname: str = field(default_factory=socket.gethostname)
    # Filled by start() (or attach()).
    ctld_port: int = 0
    node_ports: list[int] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    started_munged: bool = False

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()

    # --- what clients need -------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.n_nodes + 1)]

    @property
    def conf_dir(self) -> Path:
        return self.workdir / "etc"

    @property
    def conf_path(self) -> Path:
        return self.conf_dir / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "log"

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF: pass to any subprocess that runs a Slurm command."""
        return {**os.environ, "SLURM_CONF": str(self.conf_path)}

    def run(self, *argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; text output captured."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check, stdin=subprocess.DEVNULL)

    # --- start ---------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> LocalSlurmCluster:
        if not slurm_installed():
            raise ClusterError("Slurm is not installed (slurmctld, slurmd, sinfo): run bash .ci/setup.sh")
        self._make_dirs()
        munged = ensure_munged(self.log_dir / "munged.out")
        if munged is not None:
            self.started_munged = True
            self.pids["munged"] = munged.pid
        try:
            # Held until every daemon listens (nodes idle): the ports are then bound, not just free.
            with open(PORT_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._write_conf()
                env = self.env
                ctld = procs.start_daemon([SLURMCTLD, "-D", "-i", "-f", str(self.conf_path)],
                                          self.log_dir / "slurmctld.out", env)
                self.pids["slurmctld"] = ctld.pid
                for node in self.nodes:
                    d = procs.start_daemon([SLURMD, "-D", "-N", node, "-f", str(self.conf_path)],
                                           self.log_dir / f"slurmd-{node}.out", env)
                    self.pids[node] = d.pid
                self._save_state()
                self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _make_dirs(self) -> None:
        for sub in ("etc", "state", "run", "log", *(f"spool/{n}" for n in self.nodes),
                    *(f"tmp/{n}" for n in self.nodes)):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)

    def _write_conf(self) -> None:
        # Ports: slurmctld, the (unused) default SlurmdPort, then one per node.
        base = _free_port_block(self.n_nodes + 2)
        self.ctld_port = base
        self.node_ports = [base + 2 + i for i in range(self.n_nodes)]
        text = Template(TEMPLATE.read_text()).substitute(
            workdir=self.workdir,
            n_nodes=self.n_nodes,
            cluster_name=self.cluster_name,
            hostname=self.hostname,
            ctld_port=self.ctld_port,
            slurmd_port=base + 1,
            node_range=f"n[1-{self.n_nodes}]",
            node_ports=f"[{self.node_ports[0]}-{self.node_ports[-1]}]",
            cpus=self.cpus_per_node,
            real_memory=self.real_memory_mb,
            partition=self.partition,
        )
        self.conf_path.write_text(text)
        prolog = self.workdir / "etc" / "task_prolog.sh"
        prolog.write_text(TASK_PROLOG.format(tmp=self.workdir / "tmp"))
        prolog.chmod(0o755)

    def node_states(self) -> dict[str, str]:
        """{node: state} as sinfo reports it (e.g. 'idle', 'alloc', 'down*')."""
        out = self.run("sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %t", timeout=15).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        last_error = ""
        while time.monotonic() < deadline:
            dead = [name for name, pid in self.pids.items() if not procs.alive(pid)]
            if dead:
                raise ClusterError(f"{', '.join(dead)} exited during start-up\n{self.log_tails()}")
            try:
                states = self.node_states()
                last_error = ""
            except subprocess.SubprocessError as exc:  # slurmctld not listening yet
                last_error = str(getattr(exc, "stderr", "") or exc).strip()
            if len(states) == self.n_nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.2)
        raise ClusterError(
            f"nodes not all idle after {timeout:.0f} s: {states or 'no answer from slurmctld'}"
            f"{' (' + last_error + ')' if last_error else ''}\n{self.log_tails()}")

    def log_tails(self) -> str:
        logs = [self.log_dir / "slurmctld.log", self.log_dir / "slurmctld.out"]
        for node in self.nodes:
            logs += [self.log_dir / f"slurmd-{node}.log", self.log_dir / f"slurmd-{node}.out"]
        return "\n".join(_tail(p) for p in logs if p.exists() and p.stat().st_size)

    # --- stop ----------------------------------------------------------------
    def cancel_all_jobs(self, timeout: float = 30.0) -> None:
        """scancel every job that still holds or wants resources; wait until none is left."""
        try:
            ids = self._active_job_ids()
            if ids:
                self.run("scancel", *sorted(ids), timeout=15, check=False)
            deadline = time.monotonic() + timeout
            while ids and time.monotonic() < deadline:
                time.sleep(0.2)
                ids = self._active_job_ids()
        except (subprocess.SubprocessError, OSError):
            pass  # slurmctld is gone: the daemons are stopped below all the same

    def _active_job_ids(self) -> set[str]:
        out = self.run("squeue", "-h", "-t", ACTIVE_STATES, "-o", "%F", timeout=15).stdout
        return {line.strip() for line in out.splitlines() if line.strip()}

    def stop(self, cancel_timeout: float = 30.0) -> None:
        """Cancel jobs, then stop slurmd's, leftover slurmstepd, slurmctld and our munged."""
        if self.pids.get("slurmctld") and procs.alive(self.pids["slurmctld"]):
            self.cancel_all_jobs(cancel_timeout)
        procs.terminate([self.pids[n] for n in self.nodes if n in self.pids])
        # slurmstepd outlives a killed slurmd; ours carry our SLURM_CONF in their environment.
        procs.terminate(procs.find_processes("slurmstepd", f"SLURM_CONF={self.conf_path}"), timeout=5)
        if "slurmctld" in self.pids:
            procs.terminate([self.pids["slurmctld"]])
        if self.started_munged and "munged" in self.pids and not procs.find_processes("slurmctld"):
            procs.terminate([self.pids["munged"]])
        self.pids.clear()
        self.started_munged = False
        self._save_state()

    def remove(self) -> None:
        """Delete the workdir (after stop())."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- state file: lets `python -m tests.cluster down` stop a cluster it did not start
    @property
    def state_path(self) -> Path:
        return self.workdir / "cluster.json"

    def _save_state(self) -> None:
        state = {"n_nodes": self.n_nodes, "cpus_per_node": self.cpus_per_node,
                 "partition": self.partition, "hostname": self.hostname,
                 "ctld_port": self.ctld_port, "node_ports": self.node_ports,
                 "pids": self.pids, "started_munged": self.started_munged}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)

    @classmethod
    def attach(cls, workdir: Path) -> LocalSlurmCluster:
        """The cluster whose state file is in `workdir` (started by another process)."""
        state = json.loads((Path(workdir) / "cluster.json").read_text())
        return cls(workdir=Path(workdir), n_nodes=state["n_nodes"],
                   cpus_per_node=state["cpus_per_node"], partition=state["partition"],
                   hostname=state["hostname"], ctld_port=state["ctld_port"],
                   node_ports=state["node_ports"], pids=state["pids"],
                   started_munged=state["started_munged"])

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
