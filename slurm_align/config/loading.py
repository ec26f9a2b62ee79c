"""YAML loading, dotted overrides, profile lookup and the run-vs-profile cross checks.

Every failure here is a ConfigError naming file, field, value and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from slurm_align import PROFILES_DIR
from slurm_align.config.errors import ConfigError
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig

M = TypeVar("M", bound=pydantic.BaseModel)

DEFAULT_PROFILE = "local"
PROFILE_PATH_ENV = "SLURM_ALIGN_PROFILE_PATH"
"""Colon-separated folders of the user's own profiles, searched before cluster_profiles/."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(["file not found"], path) from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError, OSError) as e:
        raise ConfigError([f"cannot read file ({e.__class__.__name__}: {e.strerror or e})"], path) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"YAML syntax error{where}: {problem}"], path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level must be a mapping of fields, got {type(data).__name__}"], path)
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str = "command line") -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars/lists (`x=3`, `y=[1,2]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError([f"override {item!r} must look like a.b.c=value"], source)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError.at(key, item, f"'{part}' is a value, not a section", source)
            node = child
        node[parts[-1]] = value
    return data


def validate(model: type[M], data: dict[str, Any], source: str | Path | None) -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, source) from None


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    data = apply_overrides(read_yaml(path), overrides or [], source=f"{path} (overrides)")
    return validate(RunConfig, data, path)


def profile_search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get(PROFILE_PATH_ENV, "").split(":") if p]
    return dirs + [PROFILES_DIR]


def available_profiles() -> list[str]:
    names = set()
    for d in profile_search_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def find_profile(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not candidate.exists():
            raise ConfigError.at("--profile", name_or_path, "no such profile file", source=candidate)
        return candidate
    for d in profile_search_dirs():
        p = d / f"{name_or_path}.yaml"
        if p.exists():
            return p
    raise ConfigError.at(
        "--profile", name_or_path,
        f"unknown profile; available: {', '.join(available_profiles()) or '(none)'} "
        f"(searched {', '.join(str(d) for d in profile_search_dirs())}), or give a path to a .yaml file")


def load_profile(name_or_path: str | None = None, overrides: list[str] | None = None) -> ClusterProfile:
    path = find_profile(name_or_path or DEFAULT_PROFILE)
    data = read_yaml(path)
    data.setdefault("name", path.stem)
    data = apply_overrides(data, overrides or [], source=f"{path} (overrides)")
    return validate(ClusterProfile, data, path)


def check_against_profile(run: RunConfig, profile: ClusterProfile, source: str | Path | None = None) -> None:
    """TP x PP x DP of each component must equal the ranks the profile gives it."""
    problems = []
    for comp in run.components:
        if comp not in profile.components:
            problems.append(f"profile '{profile.name}' has no resources for component '{comp}' "
                            f"(components: {', '.join(profile.components) or 'none'})")
            continue
        res = profile.components[comp]
        par = run.parallel(comp)
        if par.world_size != res.ranks:
            problems.append(
                f"field '{comp}': tensor_parallel x pipeline_parallel x data_parallel = "
                f"{par.tensor_parallel}x{par.pipeline_parallel}x{par.data_parallel} = {par.world_size}, "
                f"but profile '{profile.name}' gives {comp} {res.nodes} node(s) x {res.tasks_per_node} "
                f"task(s) = {res.ranks} ranks; they must be equal")
        if res.gpus_per_node and res.gpus_per_node != res.tasks_per_node:
            problems.append(
                f"profile '{profile.name}' field 'components.{comp}': gpus_per_node={res.gpus_per_node} "
                f"but tasks_per_node={res.tasks_per_node}; one rank per GPU is required")
    if problems:
        raise ConfigError(problems, source)
