"""Render the job script (hetjob, plain or local) from the shipped sbatch templates with Jinja2.

The script runs in the run directory and starts each rank as `python -m slurm_align.launchers.<name>`:
the package installed where the job runs (a venv, or the container of a container profile) is
what runs, never a path into the submitting machine's source tree.

Every profile value reaches the script shell-quoted (exports, commands, and #SBATCH values, which
sbatch unquotes the same way), Slurm names are checked against a strict character set, and no
value may hold a control character (a newline would start a script line of its own): a value such
as `x; rm -rf ~` can never run. Secrets appear by name only.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import socket
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2

from slurm_align import __version__, resources
from slurm_align.config.components import component_kind, leader, serving_components
from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile, ComponentResources
from slurm_align.config.run import RunConfig
from slurm_align.rundir import RunDir

# Slurm names (partition, account, qos) and sizes (time, mem): no spaces, quotes or shell
# metacharacters (no real name has them, and a typo with them is better caught here).
_NAME_VALUE = re.compile(r"^[A-Za-z0-9_.,:@%/+=\-\[\]]*$")
# No rendered value may hold a control character: a newline would end a comment or an #SBATCH
# line and start a script line of its own (shell injection), and sbatch stops reading directives
# at the first non-comment line.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def refuse_control_characters(field: str, value: object, source: str | None = None) -> None:
    text = str(value)
    if _CONTROL.search(text):
        raise ConfigError.at(field, text, "control characters (newline, tab, escape, ...) are not allowed: "
                             "the value is written into the job script", source=source)


def _walk(prefix: str, value: object):
    """(dotted field, text) for every string in a dumped model, lists indexed."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(f"{prefix}[{i}]", v)
    elif isinstance(value, (str, Path)):
        yield prefix, str(value)


def check_rendered_values(profile: ClusterProfile, run_dir: Path, entry: Entry) -> None:
    """Every value that reaches the script, checked before anything is written or submitted."""
    refuse_control_characters("--run-dir", run_dir)
    for field, text in _walk("", profile.model_dump(mode="json")):
        refuse_control_characters(field, text, source=f"profile '{profile.name}'")
    for comp, args in (entry.extra_args or {}).items():
        for i, arg in enumerate(args):
            refuse_control_characters(f"entry.extra_args.{comp}[{i}]", arg)
    for comp, path in (entry.scripts or {}).items():
        refuse_control_characters(f"entry.scripts.{comp}", path)
    if profile.kind == "slurm":
        for ch, why in (("\\", "sbatch drops a backslash from #SBATCH values, so --output would name "
                                "another path"),
                        ("%", "sbatch reads % in --output as a pattern (%j, %N, ...), so the log would "
                              "go to another path")):
            if ch in str(run_dir):
                raise ConfigError.at("--run-dir", str(run_dir), f"may not contain {ch!r} on a Slurm "
                                     f"profile: {why}")


@dataclass(frozen=True)
class ComponentScript:
    name: str
    ranks: int
    nodes: int
    sbatch: list[str]      # "--key=value" flags for this component's #SBATCH lines
    start: list[str]       # already-quoted launcher prefix (srun ... / mpirun ...)
    env: list[str]         # already-quoted NAME=value for this component's launcher line
    command: list[str]     # the rank's command, quoted by the template
    python: str = ""       # the interpreter the ranks run
    preflight: Sequence[str] = ()   # already-quoted srun prefix of the component's pre-flight step


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
        """What follows `python -u`: the component kind's launcher module (config/components.py)
        for a rollout run, `-m slurm_align.launchers.<name>` for an entry or a trainer, or an
        injected script."""
        if self.scripts and component in self.scripts:
            return [str(Path(self.scripts[component]).resolve())]
        if not self.name and run.spec.rollout:
            return ["-m", component_kind(component).launcher]
        name = self.launcher(run, component)
        if name not in resources.launcher_names():
            raise ConfigError.at("entry", name, f"no launcher '{name}'; available: "
                                 f"{', '.join(resources.launcher_names())}")
        return ["-m", resources.launcher_module(name)]

    def args(self, component: str) -> list[str]:
        return list((self.extra_args or {}).get(component, []))


def _flag(key: str, value: object, field: str, profile: ClusterProfile, *, name: bool = False) -> str:
    """One `--key=value` for an #SBATCH line, written so that sbatch reads the value back exactly.

    sbatch splits a directive like a shell does: single and double quotes group (and are removed),
    a backslash escapes (and is removed, even inside single quotes), unquoted `#` after a space
    ends the line. So free text (constraint `gpu&hbm80g`, `[rack1|rack2]`, a comment with spaces)
    is shell-quoted, and a backslash is refused (checked with `scontrol show job`, Slurm 22.05;
    tests/unit/slurm/test_render.py::test_sbatch_reads_values_back_exactly)."""
    text = str(value)
    source = f"profile '{profile.name}'"
    if name and not _NAME_VALUE.match(text):
        raise ConfigError.at(
            field, text,
            "Slurm names and sizes may only hold letters, digits and _ . , : @ % / + = - [ ] "
            "(no spaces, quotes or shell metacharacters)", source=source)
    if "\\" in text:
        raise ConfigError.at(field, text, "sbatch drops a backslash from #SBATCH values (even quoted); "
                             "write the value without one", source=source)
    return f"--{key}={shlex.quote(text)}" if text != "" else f"--{key}"


def _component_flags(profile: ClusterProfile, comp: str) -> list[str]:
    return _resource_flags(profile, profile.resources(comp), f"components.{comp}")


def _single_allocation(profile: ClusterProfile, components: list[str]) -> ComponentResources:
    """`job_shape: single`: one allocation big enough for every component on nodes of its own
    (nodes summed; per node the most tasks, CPUs per task and GPUs any component needs)."""
    res = [profile.resources(c) for c in components]
    for field in ("partition", "mem"):
        values = {getattr(r, field) for r in res}
        if len(values) > 1:
            raise ConfigError.at(f"components.*.{field}", sorted(str(v) for v in values),
                                 "job_shape 'single' is one job: every component needs the same value "
                                 "(or use job_shape 'hetjob')", source=f"profile '{profile.name}'")
    extra: dict[str, str] = {}
    for c, r in zip(components, res):
        for k, v in r.sbatch_extra.items():
            if extra.setdefault(k, v) != v:
                raise ConfigError.at(f"components.{c}.sbatch_extra.{k}", v, "job_shape 'single' is one job: "
                                     f"another component sets {k}={extra[k]!r}", source=f"profile '{profile.name}'")
    return ComponentResources(nodes=sum(r.nodes for r in res), tasks_per_node=max(r.tasks_per_node for r in res),
                              gpus_per_node=max(r.gpus_per_node for r in res),
                              cpus_per_task=max(r.cpus_per_task for r in res), mem=res[0].mem,
                              partition=res[0].partition, sbatch_extra=extra)


def _resource_flags(profile: ClusterProfile, res: ComponentResources, path: str) -> list[str]:
    flags = []
    partition = res.partition or profile.partition
    if partition:
        flags.append(_flag("partition", partition, f"{path}.partition" if res.partition else "partition",
                           profile, name=True))
    for key, value in (("account", profile.account), ("qos", profile.qos)):
        if value:
            flags.append(_flag(key, value, key, profile, name=True))
    if profile.constraint:
        flags.append(_flag("constraint", profile.constraint, "constraint", profile))
    flags.append(_flag("time", profile.time, "time", profile, name=True))   # one limit for the whole job
    flags.append(f"--nodes={res.nodes}")
    flags.append(f"--ntasks-per-node={res.tasks_per_node}")
    flags.append(f"--cpus-per-task={res.cpus_per_task}")
    if res.gpus_per_node:
        flags.append(f"--gpus-per-node={res.gpus_per_node}")
    if res.mem is not None:
        flags.append(_flag("mem", res.mem, f"{path}.mem", profile, name=True))
    for key, value in profile.sbatch_extra.items():
        flags.append(_flag(key, value, f"sbatch_extra.{key}", profile))
    for key, value in res.sbatch_extra.items():
        flags.append(_flag(key, value, f"{path}.sbatch_extra.{key}", profile))
    return flags


def _refuse_array_on_hetjob(profile: ClusterProfile, components: list[str]) -> None:
    """Slurm has no job arrays of heterogeneous jobs (sbatch refuses the pair)."""
    fields = [("sbatch_extra.array", profile.sbatch_extra)] + [
        (f"components.{c}.sbatch_extra.array", profile.resources(c).sbatch_extra) for c in components]
    for field, extra in fields:
        if "array" in extra:
            raise ConfigError.at(field, extra["array"], "a job array cannot be a heterogeneous job (Slurm "
                                 f"supports neither); this run has {len(components)} components "
                                 f"({', '.join(components)}): submit one job per array index instead "
                                 "(e.g. `slurm-align sweep`)", source=f"profile '{profile.name}'")


CONTAINER_SETUP = "container_setup.sh"
"""RUN_DIR file with the profile's container.setup lines, sourced inside the container."""


def container_setup_text(profile: ClusterProfile) -> str | None:
    if profile.container is None or not profile.container.setup:
        return None
    return "# Rendered by slurm-align from the profile's container.setup; sourced in the container.\n" + \
        "".join(f"{line}\n" for line in profile.container.setup)


def input_paths(run: RunConfig) -> list[Path]:
    """Every file or folder the run reads (absolute), for the container's mounts."""
    found = []
    for section, names in (("data", ("train_path", "val_path")), ("model", ("init_checkpoint", "hf_path")),
                           ("critic_model", ("init_checkpoint", "hf_path")), ("eval", ("val_path",))):
        sub = getattr(run, section, None)
        if sub is None:
            continue
        for name in names:
            if getattr(sub, name, None) is not None:
                found.append(Path(getattr(sub, name)).absolute())
        found += [Path(src.path).absolute() for src in getattr(sub, "mixture", [])]
        tok = getattr(getattr(sub, "tokenizer", None), "path", None)
        if tok is not None:
            found.append(Path(tok).absolute())
    # The config's own inputs in field order, then the user's code: an order that does not
    # depend on where either lives (a sort by path would move with the checkout's location).
    return list(dict.fromkeys([*found, *user_code_paths(run)]))


def user_code_paths(run: RunConfig) -> list[Path]:
    """Where the run's own Python modules live on this machine (reward.rule, eval.scorer,
    plugins): the top-level package's folder, or the module's file, that the ranks import by
    the same sys.path (PYTHONPATH is passed on to the job). Installed code (the standard library,
    site-packages, slurm_align itself) comes with the image and is not mounted; a module not
    found here is left to the ranks' import, which names it."""
    modules = [spec.partition(":")[0] for spec in (run.reward.rule, run.eval.scorer) if spec]
    installed = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_paths().get(key))}
    found = set()
    for top in {m.split(".")[0] for m in [*modules, *run.plugins]} - {"slurm_align"}:
        try:
            spec = importlib.util.find_spec(top)   # a top-level name: nothing is imported
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations)))
        elif spec.origin and spec.has_location:
            path = Path(spec.origin)
        else:
            continue   # built-in or frozen
        path = path.resolve()
        if any(path.is_relative_to(root) for root in installed) or {"site-packages", "dist-packages"} & set(path.parts):
            continue
        found.add(path)
    return sorted(found)


def _container_flags(profile: ClusterProfile, comp: str, run_dir: Path, inputs: list[Path]) -> list[str]:
    """pyxis options: the image, named per component (imported once per node and reused by the
    pre-flight and the ranks), the run directory as working directory, the run directory and the
    inputs mounted at their own paths, home not mounted unless asked."""
    c = profile.container
    assert c is not None, "called for a profile with a container"
    mounts = [f"{run_dir}:{run_dir}"] + [f"{p}:{p}:ro" for p in inputs] + list(c.mounts)
    for m in mounts:
        if "," in m:
            raise ConfigError.at("container.mounts", m, "a mount path may not contain ',' (pyxis splits "
                                 "--container-mounts at commas)", source=f"profile '{profile.name}'")
    flags = [f"--container-image={c.image}", f"--container-name=slurm-align-{comp}",
             f"--container-workdir={run_dir}", f"--container-mounts={','.join(mounts)}"]
    if not c.mount_home:
        flags.append("--no-container-mount-home")
    return [shlex.quote(f) for f in flags]


def _placement(profile: ClusterProfile, comp: str, het_group: int | None, single: int | None) -> list[str]:
    """Which nodes a component's step runs on: its hetjob component, or in a single allocation
    its own node set (exported by the script as SLURM_ALIGN_NODELIST_<i>)."""
    if het_group is not None:
        return [f"--het-group={het_group}"]
    if single is not None:
        res = profile.resources(comp)
        return [f"--nodes={res.nodes}", f"--ntasks={res.ranks}", f"--ntasks-per-node={res.tasks_per_node}",
                f'--nodelist="$SLURM_ALIGN_NODELIST_{single}"']
    return []


def _start_prefix(profile: ClusterProfile, comp: str, het_group: int | None) -> list[str]:
    """The launcher in front of a component's ranks, each word already shell-quoted.

    srun gets the CPU count itself: since Slurm 22.05 it no longer inherits sbatch's
    --cpus-per-task (each rank would get one core). `--wait` is always written so a site's
    WaitTime does not kill a rank still saving after the others ended."""
    res = profile.resources(comp)
    if profile.kind == "local":
        return [shlex.quote(profile.mpirun), "--oversubscribe", "--bind-to", "none", "-n", str(res.ranks)]
    prefix = ["srun"]
    prefix += [f"--mpi={profile.mpi}", "--kill-on-bad-exit=1", f"--wait={profile.srun_wait_s}",
               f"--cpus-per-task={res.cpus_per_task}", shlex.quote(f"--cpu-bind={res.cpu_bind}")]
    if res.gpus_per_task is not None:
        prefix.append(f"--gpus-per-task={res.gpus_per_task}")
    if res.gpu_bind is not None:
        prefix.append(shlex.quote(f"--gpu-bind={res.gpu_bind}"))
    prefix += [shlex.quote(opt) for opt in res.srun_extra]
    return prefix


def _preflight_prefix(profile: ClusterProfile, comp: str, het_group: int | None,
                      index: int | None = None) -> list[str]:
    """srun for the pre-flight: one task per node of the component, in the ranks' environment
    (the same container), failing at once."""
    if profile.kind != "slurm":
        return []
    res = profile.resources(comp)
    prefix = ["SRUN_CPUS_PER_TASK=1", "srun"]
    if het_group is not None:
        prefix.append(f"--het-group={het_group}")
    else:   # plain job (one component), or its own node set of a single allocation
        prefix.append(f'--nodelist="$SLURM_ALIGN_NODELIST_{index}"' if index is not None else "")
    prefix = [w for w in prefix if w]
    prefix += [f"--nodes={res.nodes}", f"--ntasks={res.nodes}", "--ntasks-per-node=1", "--cpus-per-task=1",
               "--kill-on-bad-exit=1",
               "--wait=0", "--mpi=none"]
    return prefix


def _component_env(profile: ClusterProfile, comp: str) -> list[str]:
    """Variables set on this component's launcher line only (they differ per component)."""
    res = profile.resources(comp)
    env = {}
    if profile.kind == "slurm":
        env["SRUN_CPUS_PER_TASK"] = res.cpus_per_task   # for any srun the ranks start themselves
    if "OMP_NUM_THREADS" not in profile.env:   # the profile's own value wins
        env["OMP_NUM_THREADS"] = res.cpus_per_task
    return [f"{k}={shlex.quote(str(v))}" for k, v in env.items()]


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
    if len(run.components) == 1 or profile.job_shape == "single":
        return "plain.sh.j2"
    return "hetjob.sh.j2"


def job_python(profile: ClusterProfile) -> str:
    """The interpreter the ranks run: the profile's, else in a container the container's
    `python3` (the login node's interpreter path means nothing there), else this one."""
    if profile.python:
        return profile.python
    return "python3" if profile.container else sys.executable


def render_script(run: RunConfig, profile: ClusterProfile, run_dir: Path, entry: Entry = Entry()) -> str:
    """The whole job script for this run on this profile (nothing is written or submitted)."""
    check_rendered_values(profile, Path(run_dir), entry)
    rd = RunDir(Path(run_dir).resolve())
    python = job_python(profile)
    several = profile.kind == "slurm" and len(run.components) > 1
    hetjob = several and profile.job_shape == "hetjob"
    single = several and profile.job_shape == "single"
    inputs = input_paths(run)

    def containers(comp: str) -> list[str]:
        return _container_flags(profile, comp, rd.root, inputs) if profile.container and profile.kind == "slurm" else []

    components = []
    for i, comp in enumerate(run.components):
        key = component_kind(comp).resource_key
        if key not in profile.components:
            raise ConfigError([f"profile '{profile.name}' has no 'components.{key}' section, "
                               f"which a '{run.algorithm}' run needs"])
        res = profile.resources(comp)
        components.append(ComponentScript(
            name=comp,
            ranks=res.ranks,
            nodes=res.nodes,
            sbatch=(_component_flags(profile, comp) if not single else
                    _resource_flags(profile, _single_allocation(profile, list(run.components)), "components"))
            if profile.kind == "slurm" else [],
            start=_start_prefix(profile, comp, i if hetjob else None)[:1]
            + _placement(profile, comp, i if hetjob else None, i if single else None)
            + _start_prefix(profile, comp, i if hetjob else None)[1:] + containers(comp),
            env=_component_env(profile, comp),
            python=python,
            preflight=_preflight_prefix(profile, comp, i if hetjob else None, i if single else None)
            + containers(comp),
            command=[python, "-u", *entry.program(run, comp), "--run-dir", str(rd.root), *entry.args(comp)],
        ))
    if hetjob:
        _refuse_array_on_hetjob(profile, list(run.components))
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
        container_setup=container_setup_text(profile) is not None,
        single=single,
        max_restarts=run.fault_tolerance.max_restarts,
        leader=leader().name,
        addresses=[rd.address(c).name for c in serving_components(run.components)],
    )
