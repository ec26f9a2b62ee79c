"""A real local Slurm cluster for the tests (munge, slurmctld, several slurmd on this host)."""

from .cluster import ClusterError, LocalSlurmCluster, slurm_installed

__all__ = ["ClusterError", "LocalSlurmCluster", "slurm_installed"]
