"""Render the job script (hetjob, plain or local) from the shipped sbatch templates with Jinja2.

The script runs in the run directory and starts each rank as `python -m slurm_align.launchers.<name>`:
the package installed where the job runs (a venv, or the container of a container profile) is
what runs, never a path into the submitting machine's source tree.

Every profile value reaches the script either shell-quoted (exports, commands) or checked
against a strict character set (#SBATCH lines, which sbatch reads itself): a value such as
`x; rm -rf ~` can never run. Secrets appear by name only.
"""

from __future__ import annotations

import re
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2

from slurm_align import __version__, resources
from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.rundir import RunDir

# What may stand in an #SBATCH value: no spaces, quotes, newlines or shell metacharacters.
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%/+=\-\[\]]*$")


@dataclass(frozen=True)
class ComponentScript:
    name: str
    ranks: int
    sbatch: list[str]      # "--key=value" flags for this component's #SBATCH lines
    start: list[str]       # already-quoted launcher prefix (srun ... / mpirun ...)
    command: list[str]     # the rank's command, quoted by the template


@dataclass(frozen=True)
class Entry:
    """Which launcher (launchers/<name>.py, run as a module) the ranks run, and extra arguments per
    component.

    Default: actor/critic for the rollout algorithms (ppo, grpo, ...), train for sft/rm/dpo.
    `report` checks a profile."""

    name: str | None = None
    extra_args: dict[str, list[str]] | None = None
    scripts: dict[str, Path] | None = None
    """Per component, a launcher script outside launchers/ (tests use this to inject faults)."""

    def launcher(self, run: RunConfig, component: str) -> str:
        if self.name:
            return self.name
        return component if run.spec.rollout else "train"

    def program(self, run: RunConfig, component: str) -> list[str]:
        """What follows `python -u`: `-m slurm_align.launchers.<name>`, or an injected script."""
        if self.scripts and component in self.scripts:
            return [str(Path(self.scripts[component]).resolve())]
        name = self.launcher(run, component)
        if name not in resources.launcher_names():
            raise ConfigError.at("entry", name, f"no launcher '{name}'; available: "
                                 f"{', '.join(resources.launcher_names())}")
        return ["-m", resources.launcher_module(name)]

    def args(self, component: str) -> list[str]:
        return list((self.extra_args or {}).get(component, []))


def _flag(key: str, value: object, field: str, profile: ClusterProfile) -> str:
    text = str(value)
    if not _SBATCH_VALUE.match(text):
        raise ConfigError.at(
            field, text,
            "sbatch values may only hold letters, digits and _ . , : @ % / + = - [ ] "
            "(no spaces, quotes or shell metacharacters)",
            source=f"profile '{profile.name}'")
    return f"--{key}={text}" if text != "" else f"--{key}"


def _component_flags(profile: ClusterProfile, comp: str) -> list[str]:
    res = profile.resources(comp)
    path = f"components.{comp}"
    flags = []
    partition = res.partition or profile.partition
    if partition:
        flags.append(_flag("partition", partition, f"{path}.partition" if res.partition else "partition", profile))
    for key, value, field in (("account", profile.account, "account"), ("qos", profile.qos, "qos"),
                              ("constraint", profile.constraint, "constraint")):
        if value:
            flags.append(_flag(key, value, field, profile))
    flags.append(_flag("time", res.time or profile.time, f"{path}.time" if res.time else "time", profile))
    flags.append(f"--nodes={res.nodes}")
    flags.append(f"--ntasks-per-node={res.tasks_per_node}")
    flags.append(f"--cpus-per-task={res.cpus_per_task}")
    if res.gpus_per_node:
        flags.append(f"--gpus-per-node={res.gpus_per_node}")
    if res.mem is not None:
        flags.append(_flag("mem", res.mem, f"{path}.mem", profile))
    for key, value in profile.sbatch_extra.items():
        flags.append(_flag(key, value, f"sbatch_extra.{key}", profile))
    return flags


def _start_prefix(profile: ClusterProfile, comp: str, het_group: int | None) -> list[str]:
    res = profile.resources(comp)
    if profile.kind == "local":
        return [shlex.quote(profile.mpirun), "--oversubscribe", "--bind-to", "none", "-n", str(res.ranks)]
    prefix = ["srun"]
    if het_group is not None:
        prefix.append(f"--het-group={het_group}")
    prefix += [f"--mpi={profile.mpi}", "--kill-on-bad-exit=1"]
    if profile.container:
        prefix.append(shlex.quote(f"--container-image={profile.container.image}"))
        if profile.container.mounts:
            prefix.append(shlex.quote(f"--container-mounts={','.join(profile.container.mounts)}"))
    return prefix


def _emulated_env(run: RunConfig, profile: ClusterProfile) -> str:
    """On the local profile, the variables a Slurm hetjob would give each component."""
    if profile.kind != "local":
        return ""
    host = socket.gethostname()
    lines = [f"export SLURM_HET_SIZE={len(run.components)}"]
    for i, comp in enumerate(run.components):
        lines.append(f"export SLURM_JOB_NODELIST_HET_GROUP_{i}={shlex.quote(host)}")
        lines.append(f"export SLURM_NTASKS_HET_GROUP_{i}={profile.resources(comp).ranks}")
    return "\n".join(lines)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.folder(resources.TEMPLATES))),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    return env


def template_name(run: RunConfig, profile: ClusterProfile) -> str:
    if profile.kind == "local":
        return "local.sh.j2"
    return "hetjob.sh.j2" if len(run.components) > 1 else "plain.sh.j2"


def job_python(profile: ClusterProfile) -> str:
    """The interpreter the ranks run: the profile's, else in a container the container's
    `python3` (the login node's interpreter path means nothing there), else this one."""
    if profile.python:
        return profile.python
    return "python3" if profile.container else sys.executable


def render_script(run: RunConfig, profile: ClusterProfile, run_dir: Path, entry: Entry = Entry()) -> str:
    """The whole job script for this run on this profile (nothing is written or submitted)."""
    rd = RunDir(Path(run_dir).resolve())
    python = job_python(profile)
    hetjob = profile.kind == "slurm" and len(run.components) > 1
    components = []
    for i, comp in enumerate(run.components):
        if comp not in profile.components:
            raise ConfigError([f"profile '{profile.name}' has no 'components.{comp}' section, "
                               f"which a '{run.algorithm}' run needs"])
        res = profile.resources(comp)
        components.append(ComponentScript(
            name=comp,
            ranks=res.ranks,
            sbatch=_component_flags(profile, comp) if profile.kind == "slurm" else [],
            start=_start_prefix(profile, comp, i if hetjob else None),
            command=[python, "-u", *entry.program(run, comp), "--run-dir", str(rd.root), *entry.args(comp)],
        ))
    job_name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"sa-{run.algorithm}-{rd.root.name}")[:64]
    return _environment().get_template(template_name(run, profile)).render(
        version=__version__,
        job_name=job_name,
        run_dir=str(rd.root),
        logs=str(rd.logs),
        workdir=str(rd.root),   # the job runs in the run directory, not in any source tree
        profile=profile,
        components=components,
        emulate_env=_emulated_env(run, profile),
    )
