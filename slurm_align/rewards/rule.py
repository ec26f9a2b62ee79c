"""Rule rewards: a Python function named "module:function", checked on every call.

    reward = RuleReward.load("slurm_align.rewards.sort:exact")
    reward(response="1379", prompt="7391=", fields={})       # -> 1.0

The function gets the response text, the prompt text and the data row's other fields as keyword
arguments (`fn(response, prompt, **fields)`) and must return a finite real number (int, float,
numpy scalar; a bool counts as 0/1).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class RuleRewardError(RuntimeError):
    """A rule reward could not be loaded, raised, or returned something that is not a finite
    number; the message names the function and, for a call, the sample's prompt."""


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")


def resolve_spec(spec: str, what: str, example: str, *, kind: str = "function",
                 accept: Callable[[Any], bool] = callable,
                 error: Callable[[str], Exception] = RuleRewardError) -> Any:
    """The object a "module:name" spec names (a rule reward's function, an environment's class).

    `what` and `example` word the errors ("rule reward 'x': expected 'module:function', e.g. ...");
    `accept` says whether the attribute found is the `kind` wanted; `error` makes the exception
    raised from the message."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise error(f"{what} {spec!r}: expected 'module:{kind}', e.g. {example!r}")
    try:
        mod = importlib.import_module(module)
    except Exception as e:   # ImportError, or the module itself failing at import
        raise error(f"{what} {spec!r}: cannot import module {module!r}: {type(e).__name__}: {e}") from e
    obj = getattr(mod, name, None)
    if obj is None or not accept(obj):
        raise error(f"{what} {spec!r}: module {module!r} has no {kind} {name!r}")
    return obj


@dataclass(frozen=True)
class RuleReward:
    spec: str                      # "module:function" as the user wrote it
    fn: Callable[..., Any]

    @classmethod
    def load(cls, spec: str) -> RuleReward:
        return cls(spec, resolve_spec(spec, "rule reward", "slurm_align.rewards.sort:exact"))

    def __call__(self, response: str, prompt: str, fields: dict[str, Any]) -> float:
        try:
            value = self.fn(response, prompt, **fields)
        except Exception as e:
            raise RuleRewardError(f"rule reward {self.spec} raised {type(e).__name__}: {e} "
                                  f"(prompt {_short(prompt)}, response {_short(response)})") from e
        if not isinstance(value, numbers.Real):
            raise RuleRewardError(f"rule reward {self.spec} returned {type(value).__name__} {value!r}, "
                                  f"not a number (prompt {_short(prompt)}, response {_short(response)})")
        value = float(value)
        if not math.isfinite(value):
            raise RuleRewardError(f"rule reward {self.spec} returned {value} (prompt {_short(prompt)}, "
                                  f"response {_short(response)}); rewards must be finite")
        return value

    def many(self, responses: list[str], rows: list[dict[str, Any]], prompt_key: str = "prompt") -> list[float]:
        """One reward per (response, data row); the row's prompt field is the prompt."""
        return [self(r, row[prompt_key], {k: v for k, v in row.items() if k != prompt_key})
                for r, row in zip(responses, rows)]
