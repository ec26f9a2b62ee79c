"""The test cluster's own start/stop: stop() leaves no daemon, job step or port behind."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.cluster import ClusterError, LocalSlurmCluster, slurm_installed
from tests.cluster.procs import alive, find_processes

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not slurm_installed(), reason="Slurm is not installed: run bash .ci/setup.sh"),
]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_stop_cancels_running_jobs_and_ends_every_process(tmp_path: Path) -> None:
    # A second, small cluster beside the session's one: its own ports, its own state.
    cluster = LocalSlurmCluster(tmp_path / "c", n_nodes=2, cpus_per_node=1).start()
    try:
        assert cluster.node_states() == {"n1": "idle", "n2": "idle"}
        job = cluster.run("sbatch", "--parsable", "-N2", "-o", "/dev/null",
                          "--wrap", "srun sleep 300").stdout.strip()
        deadline = time.monotonic() + 30
        while cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "job never started"
            time.sleep(0.2)
        marker = f"SLURM_CONF={cluster.conf_path}"
        deadline = time.monotonic() + 30
        while len(find_processes("slurmstepd", marker)) < 2:  # batch step + srun step
            assert time.monotonic() < deadline, "no slurmstepd seen for the running job"
            time.sleep(0.2)
        pids = dict(cluster.pids)
        ports = [cluster.ctld_port, *cluster.node_ports]
    finally:
        cluster.stop()
    assert not [name for name, pid in pids.items() if name != "munged" and alive(pid)]
    assert find_processes("slurmstepd", marker) == []
    assert not [p for p in ports if _listening(p)]
    assert cluster.pids == {}
    # The job was cancelled, not left for a dead slurmctld: the job completion log says so.
    records = [ln for ln in (cluster.workdir / "jobcomp.txt").read_text().splitlines()
               if f"JobId={job} " in ln]
    assert len(records) == 1 and "JobState=CANCELLED" in records[0], records


def test_attach_reads_back_a_running_cluster(tmp_path: Path) -> None:
    cluster = LocalSlurmCluster(tmp_path / "c", n_nodes=1, cpus_per_node=1).start()
    try:
        again = LocalSlurmCluster.attach(cluster.workdir)
        assert again.pids == cluster.pids and again.conf_path == cluster.conf_path
        assert again.node_states() == {"n1": "idle"}
    finally:
        LocalSlurmCluster.attach(cluster.workdir).stop()
    assert not alive(cluster.pids["slurmctld"])
    assert LocalSlurmCluster.attach(cluster.workdir).pids == {}  # the state file says stopped


def test_failed_start_names_the_cause_and_leaves_nothing_running(tmp_path: Path) -> None:
    cluster = LocalSlurmCluster(tmp_path / "c", n_nodes=1, real_memory_mb=-5)
    with pytest.raises(ClusterError, match=r"(?s)exited during start-up.*RealMemory value \(-5\)"):
        cluster.start(timeout=20)
    assert find_processes("slurmctld", f"SLURM_CONF={cluster.conf_path}") == []
    assert find_processes("slurmd", f"SLURM_CONF={cluster.conf_path}") == []
