"""Tools a model may call: a small interface, argument checks, and the built-in ones.

A tool has a name, a description and its parameters as a JSON-schema object (what chat
templates render into the prompt through `tools=`); `run(**arguments)` returns the text the
model reads. The arguments come from the model, so they are checked against the declared
parameters before the tool sees them (check_arguments: the subset of JSON schema that tool
declarations use: type, properties, required, additionalProperties, enum, items, minimum,
maximum). Built-in: `calculator` (calculator.py) and `python` (sandbox.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from slurm_align.config.errors import ConfigError
from slurm_align.environments import calculator
from slurm_align.environments.sandbox import SandboxLimits, run_code
from slurm_align.rewards.rule import resolve_spec

if TYPE_CHECKING:
    from slurm_align.environments.config import EnvironmentConfig

_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                       "boolean": (bool,), "array": (list,), "object": (dict,),
                                       "null": (type(None),)}


def _type_ok(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False     # JSON true is not a number
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(kind, object))


def check_arguments(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """What is wrong with `value` under a JSON-schema-like `schema` (empty list: nothing)."""
    problems: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_type_ok(value, k) for k in kinds):
            return [f"{where} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {schema['enum']}, got {value!r:.60}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{where} must be at least {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{where} must be at most {schema['maximum']}, got {value}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                problems.append(f"{where} misses required {name!r}")
        for name, item in value.items():
            if name in props:
                problems += check_arguments(props[name], item, f"{where}.{name}")
            elif schema.get("additionalProperties", False) is False:
                allowed = ", ".join(props) or "none"
                problems.append(f"{where} has unknown {name!r} (allowed: {allowed})")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += check_arguments(schema["items"], item, f"{where}[{i}]")
    return problems


class Tool(ABC):
    """One tool. `parameters` is a JSON-schema object; additional properties are refused
    unless it sets additionalProperties: true."""

    name: str = ""
    description: str = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    @classmethod
    def from_settings(cls, settings: EnvironmentConfig) -> Tool:
        """The tool for a run's environment settings (override to read them)."""
        return cls()

    @classmethod
    def for_run(cls, settings: EnvironmentConfig, run_dir: Path | None) -> Tool:
        """The tool for a run: its environment settings and its directory, which a tool that runs
        model-written code must keep from that code (override where it does; the default reads the
        settings only, through from_settings)."""
        return cls.from_settings(settings)

    @abstractmethod
    def run(self, **arguments: Any) -> str:
        """The tool's answer as the model will read it; raise to report an error."""

    def schema(self) -> dict[str, Any]:
        """The declaration chat templates take in `tools=` (OpenAI function format)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."
    parameters: ClassVar[dict[str, Any]] = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456 + 7"}},
                  "required": ["expression"]}

    # a tool's run() takes its own schema's arguments by name; callers pass them as **arguments
    def run(self, expression: str) -> str:  # type: ignore[override]
        return calculator.format_value(calculator.evaluate(expression))


class PythonTool(Tool):
    """Model-written Python run in the sandbox (sandbox.py); the answer is its output."""

    name = "python"
    description = ("Run a Python 3 program in a fresh sandbox (no network, limited time and memory) and "
                   "return what it prints.")
    parameters: ClassVar[dict[str, Any]] = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                  "required": ["code"]}

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits

    @classmethod
    def from_settings(cls, settings: EnvironmentConfig) -> PythonTool:
        # the sandbox ends the program a little before the pool would abandon the call, so the
        # model reads "timed out" with the output so far rather than a bare timeout
        return cls(SandboxLimits(timeout_s=settings.tool_timeout_s * 0.9))

    @classmethod
    def for_run(cls, settings: EnvironmentConfig, run_dir: Path | None) -> PythonTool:
        # The run directory holds run.secret (the key to the run's critic and generator), its
        # checkpoints and logs. As root the sandbox runs the code as `nobody`, which cannot read
        # the 0600 secret; but run as a normal user (the usual case on a cluster) the code runs as
        # the user who owns every run file. So the directory is hidden in the sandbox's own mount
        # namespace; where none can be made, the sandbox refuses to run the code (exit code 125,
        # which the model reads) rather than run it with the run's files in reach.
        tool = cls.from_settings(settings)
        if run_dir is not None:
            tool.limits = replace(tool.limits, hidden_paths=(*tool.limits.hidden_paths, str(Path(run_dir).resolve())))
        return tool

    def run(self, code: str) -> str:  # type: ignore[override]  # its schema's argument, as above
        r = run_code(code, self.limits)
        parts = [r.stdout]
        if r.stderr:
            parts.append(f"[stderr]\n{r.stderr}")
        if r.output_truncated:
            parts.append(f"[output cut at {self.limits.output_bytes} bytes]")
        if r.timed_out:
            parts.append(f"[timed out after {self.limits.timeout_s:g} s]")
        elif r.exit_code != 0:
            parts.append(f"[exit code {r.exit_code}]")
        return "\n".join(p for p in parts if p)


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


def _is_tool(obj: Any) -> bool:
    return isinstance(obj, Tool) or (isinstance(obj, type) and issubclass(obj, Tool))


def load_tools(settings: EnvironmentConfig, run_dir: Path | None = None) -> dict[str, Tool]:
    """The tools settings.tools names, by their names; a user tool is 'module:name' of a Tool
    instance (used as it is) or subclass (made by its for_run with the settings and `run_dir`)."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(settings.tools):
        if spec in BUILTIN_TOOLS:
            tool = BUILTIN_TOOLS[spec].for_run(settings, run_dir)
        else:
            def error(msg, i=i):
                return ConfigError([f"field 'environment.tools[{i}]': {msg}"])
            obj = resolve_spec(spec, "tool", "my_pkg.tools:search", kind="Tool", accept=_is_tool, error=error)
            # _is_tool accepted it: a Tool subclass or a Tool instance
            tool = obj.for_run(settings, run_dir) if isinstance(obj, type) and issubclass(obj, Tool) else obj
        if not tool.name or tool.name in tools:
            raise ConfigError([f"field 'environment.tools[{i}]': tool {spec!r} has name {tool.name!r}, "
                               f"empty or already taken (tools: {', '.join(tools)})"])
        tools[tool.name] = tool
    return tools
