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
from dataclasses import dataclass
from typing import Any, Callable


class RuleRewardError(RuntimeError):
    """A rule reward could not be loaded, raised, or returned something that is not a finite
    number; the message names the function and, for a call, the sample's prompt."""


def _short(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit - 3] + "...")


@dataclass(frozen=True)
class RuleReward:
    spec: str                      # "module:function" as the user wrote it
    fn: Callable[..., Any]

    @classmethod
    def load(cls, spec: str) -> "RuleReward":
        module, sep, name = spec.partition(":")
        if not sep or not module or not name:
            raise RuleRewardError(f"rule reward {spec!r}: expected 'module:function', e.g. "
                                  "'slurm_align.rewards.sort:exact'")
        try:
            mod = importlib.import_module(module)
        except Exception as e:   # ImportError, or the module itself failing at import
            raise RuleRewardError(f"rule reward {spec!r}: cannot import module {module!r}: "
                                  f"{type(e).__name__}: {e}") from e
        fn = getattr(mod, name, None)
        if not callable(fn):
            raise RuleRewardError(f"rule reward {spec!r}: module {module!r} has no function {name!r}")
        return cls(spec, fn)

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
