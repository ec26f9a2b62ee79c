"""Shared pytest set-up: session environment, marker logic, the real Slurm cluster.

Add fixtures of your own area in their own section below (keep one section per area).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import ClusterError, LocalSlurmCluster, slurm_installed

# --- session environment ------------------------------------------------------
# MPI as root, one thread per process (2 cores shared by every rank of every test).
SESSION_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMP_NUM_THREADS": "1",
}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.update(SESSION_ENV)


# --- markers ------------------------------------------------------------------
def _cuda_available() -> bool:
    import torch  # only imported when a gpu test was collected

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test that uses the cluster is a `slurm` test, so `-m "not slurm"` deselects it.
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_ranks_for_cpu_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks a CPU test starts stay on CPU on a GPU machine too (CUDA hidden from its child
    processes): these tests are about gloo ranks, and two of them on one GPU is refused (NCCL)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# --- the real Slurm test cluster (tests/cluster) -------------------------------
@pytest.fixture(scope="session")
def slurm_cluster(request: pytest.FixtureRequest) -> Iterator[LocalSlurmCluster]:
    """munged + slurmctld + 4 slurmd (n1..n4, partition `debug`) on this host, for the session.

    Sets SLURM_CONF in os.environ, so sbatch/srun/squeue just work; stopped (jobs cancelled
    first, daemons by PID) at session end, even when tests fail; its logs are kept then.
    """
    if not slurm_installed():
        reason = "Slurm is not installed (slurmctld/slurmd/sinfo): run bash .ci/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must run the real-cluster tests)", pytrace=False)
        pytest.skip(reason)
    workdir = Path(tempfile.mkdtemp(prefix="sa-cluster-", dir="/tmp"))
    cluster = LocalSlurmCluster(workdir, n_nodes=4, cpus_per_node=2)
    try:
        cluster.start()
    except ClusterError as exc:
        pytest.fail(f"the local Slurm cluster did not start:\n{exc}", pytrace=False)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf_path)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        if request.session.testsfailed:
            print(f"\n[slurm_cluster] tests failed: daemon logs kept in {cluster.log_dir}")
        else:
            cluster.remove()
