"""The local Slurm test cluster is a real one: nodes, PMIx MPI steps, hetjobs, failed jobs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster import LocalSlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]

MPI_HELLO = textwrap.dedent("""
    import os
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    names = comm.gather(os.environ["SLURMD_NODENAME"], root=0)
    if comm.rank == 0:
        print("size", comm.size, "nodes", ",".join(names), flush=True)
""")


def _job_state(cluster: LocalSlurmCluster, job_id: str) -> str:
    out = cluster.run("scontrol", "show", "job", job_id, "-o", timeout=15).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return fields["JobState"]


def _wait_state(cluster: LocalSlurmCluster, job_id: str, timeout: float = 60) -> str:
    done = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        state = _job_state(cluster, job_id)
        if state in done:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {state!r} after {timeout} s")


def test_sinfo_shows_all_nodes_idle(slurm_cluster: LocalSlurmCluster) -> None:
    assert slurm_cluster.nodes == ["n1", "n2", "n3", "n4"]
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P %t %c"], capture_output=True,
                         text=True, check=True, timeout=15).stdout  # SLURM_CONF from the fixture
    rows = sorted(line.split() for line in out.splitlines())
    # Every node is in the default partition and in the two preemption test partitions.
    partitions = ("debug*", "preemptible", "urgent")
    assert rows == sorted([n, p, "idle", "2"] for n in slurm_cluster.nodes for p in partitions)


def test_srun_pmix_mpi_spans_two_nodes(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(MPI_HELLO)
    proc = slurm_cluster.run("srun", "--mpi=pmix", "-N2", "-n2", "--ntasks-per-node=1",
                             sys.executable, str(script), timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("size"))
    _, size, _, names = line.split()
    nodes = names.split(",")
    assert size == "2"
    assert len(set(nodes)) == 2 and set(nodes) <= set(slurm_cluster.nodes), line


def test_hetjob_components_on_distinct_nodes(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "het.sbatch"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --nodes=1 --ntasks=1 --output={tmp_path}/het.out
        #SBATCH hetjob
        #SBATCH --nodes=1 --ntasks=1
        echo "group0=$SLURM_JOB_NODELIST_HET_GROUP_0"
        echo "group1=$SLURM_JOB_NODELIST_HET_GROUP_1"
        echo "size=$SLURM_HET_SIZE"
        srun --het-group=0 bash -c 'echo "ran0=$SLURMD_NODENAME"' &
        srun --het-group=1 bash -c 'echo "ran1=$SLURMD_NODENAME"' &
        wait
        """))
    job_id = slurm_cluster.run("sbatch", "--parsable", str(script), timeout=30).stdout.strip().split(";")[0]
    assert _wait_state(slurm_cluster, job_id, timeout=90) == "COMPLETED"
    out = dict(line.split("=", 1) for line in (tmp_path / "het.out").read_text().split() if "=" in line)
    assert out["size"] == "2"
    assert out["group0"] in slurm_cluster.nodes and out["group1"] in slurm_cluster.nodes
    assert out["group0"] != out["group1"], out
    assert (out["ran0"], out["ran1"]) == (out["group0"], out["group1"])


def test_failing_job_is_seen_failed(slurm_cluster: LocalSlurmCluster) -> None:
    job_id = slurm_cluster.run("sbatch", "--parsable", "--output=/dev/null",
                               "--wrap", "exit 1", timeout=30).stdout.strip()
    assert _wait_state(slurm_cluster, job_id, timeout=60) == "FAILED"
    # squeue -t all still lists it (MinJobAge keeps finished jobs; there is no accounting).
    out = slurm_cluster.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%i %T", timeout=15).stdout
    assert out.split() == [job_id, "FAILED"]
    exit_code = slurm_cluster.run("scontrol", "show", "job", job_id, "-o").stdout
    assert "ExitCode=1:0" in exit_code
