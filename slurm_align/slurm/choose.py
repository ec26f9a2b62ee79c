"""Which profile a command runs with when `--profile` is not given, and the paths a Slurm job
needs to see from its compute nodes.

Without `--profile`, the first profile (the user's folders first, then the shipped ones) whose
`hostname_pattern` matches this machine's hostname is taken. None matching: on a machine that has
`sbatch` (a login node) that is an error listing the profiles, never a silent `mpirun` on the login
node; elsewhere the embedded default, 'local'.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import (
    DEFAULT_PROFILE,
    available_profiles,
    find_profile,
    load_profile,
    read_yaml,
)
from slurm_align.config.profile import ClusterProfile

NODE_LOCAL_PREFIXES = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/local", "/localscratch")
"""Folders that are usually each node's own (the login node's /tmp is not the compute node's)."""


def matching_profiles(hostname: str) -> list[str]:
    found = []
    for name in available_profiles():
        try:
            pattern = read_yaml(find_profile(name)).get("hostname_pattern")
        except ConfigError:
            continue   # a broken profile is reported when it is asked for by name
        if isinstance(pattern, str):
            try:
                if re.search(pattern, hostname):
                    found.append(name)
            except re.error:
                continue
    return found


def choose_profile(name: str | None, overrides: list[str] | None = None, *, hostname: str | None = None,
                   has_sbatch: bool | None = None) -> ClusterProfile:
    """The profile named, else the one whose hostname_pattern matches, else 'local' where there
    is no Slurm; refused on a Slurm machine that no profile matches."""
    if name is not None:
        return load_profile(name, overrides)
    hostname = hostname or socket.gethostname()
    matches = matching_profiles(hostname)
    if matches:
        return load_profile(matches[0], overrides)
    if has_sbatch is None:
        has_sbatch = shutil.which("sbatch") is not None
    if has_sbatch:
        raise ConfigError.at(
            "--profile", None,
            f"none given, and no profile's hostname_pattern matches this machine ({hostname!r}), which has "
            f"sbatch: running here as '{DEFAULT_PROFILE}' would start the job on this (login) node. "
            f"Give --profile NAME (available: {', '.join(available_profiles())}; '{DEFAULT_PROFILE}' to "
            "really run here without Slurm), or set hostname_pattern in your cluster's profile")
    return load_profile(DEFAULT_PROFILE, overrides)


def default_run_root(profile: ClusterProfile) -> Path:
    """Where new run directories go: the profile's run_root ($VARS and ~ expanded), else ./runs."""
    if profile.run_root is None:
        return Path("runs")
    text = os.path.expanduser(os.path.expandvars(profile.run_root))
    if "$" in text:
        raise ConfigError.at("run_root", profile.run_root, f"expands to {text!r}: a variable in it is not set "
                             "in this shell", source=f"profile '{profile.name}'")
    return Path(text)


def _node_local(path: Path) -> str | None:
    text = str(path)
    for prefix in NODE_LOCAL_PREFIXES:
        if text == prefix or text.startswith(prefix + "/"):
            return prefix
    return None


def check_shared_paths(profile: ClusterProfile, run_dir: Path, python: str) -> None:
    """A Slurm job reads its run directory and starts its interpreter on the compute nodes: neither
    may live in a node-local folder of the submitting machine (the classic first failure: a venv
    or a run under the login node's /tmp). A profile whose nodes do share /tmp (the one-host test
    cluster) says so with `shared_tmp: true`."""
    if profile.kind != "slurm" or profile.shared_tmp:
        return
    problems = []
    prefix = _node_local(Path(run_dir))
    if prefix:
        problems.append(f"field '--run-dir': got {str(run_dir)!r}; it is under {prefix}, which is each node's "
                        "own: the compute nodes would not see the run's config and would write their logs "
                        "and checkpoints elsewhere. Use a shared file system (profile run_root, or --run-dir)")
    if os.path.isabs(python):
        prefix = _node_local(Path(python))
        if prefix:
            problems.append(f"field 'python': got {python!r}; it is under {prefix}, which is each node's own: "
                            "the compute nodes cannot start it. Install slurm-align in a venv on a shared file "
                            "system (or use a container)")
    if problems:
        raise ConfigError([*problems, "set shared_tmp: true in the profile only if every node really shares "
                                      "these folders with this machine"], f"profile '{profile.name}'")
