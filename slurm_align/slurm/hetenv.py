"""Where am I, and where are the other components? Read from the (het)job environment.

The Slurm template and the local runner set the same variables, so this works the same
in a real hetjob, on the test cluster and on the `local` profile:

    SLURM_ALIGN_COMPONENTS             component names in het-group order, e.g. "actor,critic"
    SLURM_ALIGN_COMPONENT              this process's component
    SLURM_ALIGN_RUN_DIR                the run directory
    SLURM_JOB_NODELIST_HET_GROUP_<i>   hosts of component i (Slurm's compressed host list)
    SLURM_NTASKS_HET_GROUP_<i>         ranks of component i
    SLURM_ALIGN_NODELIST_<i>, SLURM_ALIGN_NTASKS_<i>   the same for profile job_shape 'single'
                                       (one allocation; the job script sets them)
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compressed host list ("n[1-3,7],gpu-a[01-02]") into names."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        m = re.match(r"^([^\[\]]*)\[([^\]]+)\](.*)$", item)
        if not m:
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            r = _RANGE.match(part.strip())
            if not r:
                raise ValueError(f"bad host range {part!r} in host list {hostlist!r}")
            lo, hi = r.group(1), r.group(2) or r.group(1)
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                for tail in expand_hostlist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{width}d}{tail}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def resolve_address(host: str) -> str:
    """An IP address for a node name: Slurm's NodeAddr when Slurm knows the node, else DNS.

    Slurm's own view is right both on real clusters and on the one-host test cluster,
    where node names do not resolve through DNS.
    """
    if host in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True,
                                 timeout=10).stdout
        except (subprocess.TimeoutExpired, OSError):
            out = ""
        m = re.search(r"\bNodeAddr=(\S+)", out)
        if m:
            addr = m.group(1)
            try:
                return socket.gethostbyname(addr)
            except OSError:
                return addr
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise RuntimeError(f"cannot resolve the address of host {host!r} "
                           f"(not known to Slurm's scontrol and not in DNS): {e}") from None


@dataclass(frozen=True)
class HetEnv:
    components: tuple[str, ...]
    component: str
    run_dir: Path | None
    environ: Mapping[str, str] = field(repr=False, default_factory=dict)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> HetEnv:
        env = dict(os.environ if environ is None else environ)
        names = env.get("SLURM_ALIGN_COMPONENTS")
        comp = env.get("SLURM_ALIGN_COMPONENT")
        if not names or not comp:
            raise RuntimeError(
                "not inside a slurm-align job: SLURM_ALIGN_COMPONENTS and SLURM_ALIGN_COMPONENT are "
                "unset (start components through `slurm-align submit` or the launch API)")
        components = tuple(names.split(","))
        if comp not in components:
            raise RuntimeError(f"SLURM_ALIGN_COMPONENT={comp!r} is not one of {components}")
        run_dir = env.get("SLURM_ALIGN_RUN_DIR")
        return cls(components, comp, Path(run_dir) if run_dir else None, env)

    def index(self, component: str) -> int:
        try:
            return self.components.index(component)
        except ValueError:
            raise KeyError(
                f"no component {component!r} in this job (components: {', '.join(self.components)})") from None

    def hosts(self, component: str) -> list[str]:
        i = self.index(component)
        key = f"SLURM_JOB_NODELIST_HET_GROUP_{i}"
        if key not in self.environ and f"SLURM_ALIGN_NODELIST_{i}" in self.environ:
            key = f"SLURM_ALIGN_NODELIST_{i}"   # job_shape single: the component's nodes of one allocation
        if key not in self.environ and len(self.components) == 1 and "SLURM_JOB_NODELIST" in self.environ:
            key = "SLURM_JOB_NODELIST"  # a plain (non-het) job
        if key not in self.environ:
            raise RuntimeError(f"{key} is unset: cannot find the hosts of component {component!r}")
        return expand_hostlist(self.environ[key])

    def ntasks(self, component: str) -> int:
        i = self.index(component)
        return int(self.environ.get(f"SLURM_NTASKS_HET_GROUP_{i}") or self.environ.get(f"SLURM_ALIGN_NTASKS_{i}")
                   or self.environ.get("SLURM_NTASKS", "1"))

    def address(self, component: str) -> str:
        """IP address of the component's first host (its rank 0 runs there)."""
        return resolve_address(self.hosts(component)[0])


def service_host(component: str, explicit: str | None = None) -> str:
    """Where a component's service binds: `explicit` (a config field), else the address of the
    profile's network.interface on this node (the high-speed network), else the node's address
    as Slurm knows it (NodeAddr). Never every interface."""
    from slurm_align.parallel.bootstrap import INTERFACE_ENV, interface_address  # torch: only when serving
    if explicit:
        return explicit
    if os.environ.get(INTERFACE_ENV):
        return interface_address(os.environ[INTERFACE_ENV])
    return HetEnv.from_environ().address(component)
