"""Can this job ever start? Ask Slurm how many nodes each partition has.

A hetjob's components never share a node, so a job needs the sum of its components' nodes
in each partition. A job that asks for more than the partition has stays PENDING (reason
Resources) forever; it is refused before submission instead.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter

from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile


def partition_nodes(partition: str) -> int | None:
    """Nodes in `partition` (any state: down nodes may come back), None when Slurm cannot say."""
    if not shutil.which("sinfo"):
        return None
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return len({line.strip() for line in proc.stdout.splitlines() if line.strip()})


def nodes_needed(profile: ClusterProfile, components: tuple[str, ...] | list[str]) -> Counter:
    """Nodes the job asks for, per partition."""
    need: Counter = Counter()
    for comp in components:
        res = profile.resources(comp)
        need[res.partition or profile.partition] += res.nodes
    return need


def check_fits_cluster(profile: ClusterProfile, components: tuple[str, ...] | list[str],
                       what: str = "the job") -> None:
    """ConfigError when a partition has fewer nodes than `what` needs (Slurm profiles only)."""
    if profile.kind != "slurm":
        return
    problems = []
    for partition, need in nodes_needed(profile, components).items():
        have = partition_nodes(partition)
        if have is not None and need > have:
            detail = ", ".join(f"{c} {profile.resources(c).nodes}" for c in components
                               if (profile.resources(c).partition or profile.partition) == partition)
            problems.append(f"{what} needs {need} nodes in partition '{partition}' ({detail}; hetjob components "
                            f"never share a node), but it has {have}: it could never start")
    if problems:
        raise ConfigError(problems, f"profile '{profile.name}'")
