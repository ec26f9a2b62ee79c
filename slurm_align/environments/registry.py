"""Environments by name: the built-in ones, those registered by code, or a user's 'module:Class'.

    register_environment(MyEnv)           # MyEnv.name = "maze"; then environment: maze
    env = load_environment(EnvironmentContext(settings, reward_rule=...))
"""

from __future__ import annotations

from slurm_align.config.errors import ConfigError
from slurm_align.environments.base import Environment, EnvironmentContext
from slurm_align.rewards.rule import resolve_spec

# Built-ins by spec, resolved when used: their modules import this one's neighbours (tools,
# sandbox), which a config check that only needs the names should not pay for.
_BUILTIN = {
    "rule": "slurm_align.environments.rule_env:RuleEnvironment",
    "tools": "slurm_align.environments.tool_env:ToolEnvironment",
}
_REGISTERED: dict[str, type[Environment]] = {}


def _is_environment_class(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, Environment)


def register_environment(cls: type[Environment]) -> type[Environment]:
    """Make `cls` available as `environment: <cls.name>` (usable as a class decorator)."""
    if not _is_environment_class(cls) or not cls.name:
        raise TypeError(f"{cls!r}: an environment class must subclass Environment and set `name`")
    if cls.name in _BUILTIN or _REGISTERED.get(cls.name, cls) is not cls:
        raise ValueError(f"environment name {cls.name!r} is taken; registered: {', '.join(environment_names())}")
    _REGISTERED[cls.name] = cls
    return cls


def environment_names() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def _config_error(message: str) -> ConfigError:
    return ConfigError([f"field 'environment.environment': {message}"])


def environment_class(spec: str) -> type[Environment]:
    """The class a name or 'module:Class' names; a ConfigError listing the registered names
    (or saying why the import failed) otherwise."""
    if spec in _REGISTERED:
        return _REGISTERED[spec]
    if ":" not in spec and spec not in _BUILTIN:
        raise _config_error(f"got {spec!r}; unknown environment; registered: {', '.join(environment_names())} "
                            "(or a user class as 'module:Class')")
    return resolve_spec(_BUILTIN.get(spec, spec), "environment", "my_pkg.envs:Maze", kind="Environment subclass",
                        accept=_is_environment_class, error=_config_error)


def load_environment(ctx: EnvironmentContext) -> Environment:
    """The environment ctx.settings.environment names, built with ctx."""
    return environment_class(ctx.settings.environment)(ctx)
