"""The one error type for bad user input: it names file, field, value and what is allowed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic


class ConfigError(ValueError):
    """Bad user input, found before anything is submitted.

    The message always names the file (when there is one), the dotted field path,
    the offending value and what would be accepted.
    """

    def __init__(self, problems: list[str], source: str | Path | None = None):
        self.problems = problems
        self.source = str(source) if source is not None else None
        where = f"{self.source}: " if self.source else ""
        if len(problems) == 1:
            super().__init__(f"{where}{problems[0]}")
        else:
            body = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"{where}{len(problems)} problems:\n{body}")

    @classmethod
    def at(cls, field: str, value: Any, allowed: str, source: str | Path | None = None) -> ConfigError:
        return cls([f"field '{field}': got {value!r}; {allowed}"], source)

    @classmethod
    def from_validation(
        cls, err: pydantic.ValidationError, source: str | Path | None = None, prefix: str = ""
    ) -> ConfigError:
        problems = []
        for e in err.errors():
            loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
            value = e.get("input")
            msg = e["msg"]
            if e["type"] == "extra_forbidden":
                msg = "unknown key (check its spelling against the documented fields)"
            elif e["type"] == "missing":
                msg = "required field is missing"
                problems.append(f"field '{loc}': {msg}")
                continue
            if not loc and msg.startswith("Value error, field '"):
                # a cross-field check that names its own fields (RunConfig's environment checks)
                first, *rest = msg[len("Value error, "):].split("; field '")
                problems += [first, *(f"field '{p}" for p in rest)]
                continue
            ctx = e.get("ctx") or {}
            if "expected" in ctx:
                msg = f"{msg} (allowed: {ctx['expected']})"
            problems.append(f"field '{loc or '<root>'}': got {_short(value)}; {msg}")
        return cls(problems, source)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
