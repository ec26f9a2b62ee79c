"""The environment interface: what a multi-turn rollout talks to between the model's turns.

    env = load_environment(config, EnvironmentContext(reward_rule="slurm_align.rewards.arithmetic:exact_answer"))
    messages = checked_reset(env, row)                      # the first messages (the prompt)
    ... the model answers: messages.append({"role": "assistant", "content": text})
    [result] = step_all(env, [(messages, row)])             # reply messages, reward, done, metrics
    messages += result.messages                             # e.g. a tool turn; go on until result.done

A data row is a dict as the prompt dataset's `fields()` gives it: "prompt" (the text, or a chat
row's last user turn), a chat row's "messages", and the row's other fields (e.g. "answer").
A message is a dict with "role" and "content" as chat templates read it (an assistant message
may carry "tool_calls", a tool message a "name").

Environments are trusted code (the user's or ours); what the MODEL writes is hostile input.
So a tool call that goes wrong is an observation for the model (tool_env.py), while an
environment that raises, or returns something malformed, stops the run with an
EnvironmentStepError naming the environment and the data row (as rule-reward errors do).
"""

from __future__ import annotations

import functools
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:   # types only: config.py imports the registry, which imports this module
    from slurm_align.config.run import RunConfig
    from slurm_align.environments.config import EnvironmentConfig

Message = dict[str, Any]
Messages = list[Message]
Row = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have (those the chat templates of Qwen2/Llama 3.1 render)."""


class EnvironmentStepError(RuntimeError):
    """An environment failed (raised, or returned something malformed); the message names the
    environment and the data row. Stops the run: the environment is code, not model output."""


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one model turn."""

    messages: Messages
    """The environment's reply (tool turns, a user turn); empty when it has nothing to add."""
    reward: float = 0.0
    """Reward for this turn (a trajectory's return is the sum over its turns)."""
    done: bool = False
    """The conversation is over (answered, or the environment ended it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to log (e.g. tool_calls, tool_errors, tool_time_s), summed over turns."""


@dataclass(frozen=True)
class EnvironmentContext:
    """What an environment is built with: its settings and the run's pieces it may use."""

    settings: EnvironmentConfig
    """The run's `environment` settings (max turns, budgets, stop sequences, tools, options)."""
    reward_rule: str | None = None
    """The run's rule reward 'module:function' (reward.rule), scoring final answers."""
    prompt_key: str = "prompt"
    """The data row's field that holds the prompt text."""
    run_dir: Path | None = None
    """The run's directory (its secret, checkpoints, logs): model-written code must not see it,
    so the python tool hides it from its sandbox. None: no run (a test, an offline evaluation)."""

    @classmethod
    def for_run(cls, run: RunConfig) -> EnvironmentContext:
        """The context a run's ranks build their environment with."""
        return cls(run.environment, reward_rule=run.reward.rule, run_dir=run.run_dir)


class Environment(ABC):
    """One kind of environment; built once per generating rank, shared by its conversations.

    Subclasses set `name` (the registry name) and implement reset and step. step() may be
    called for several conversations at once from different threads only if step_batch is
    overridden to do so; the default step_batch calls step one conversation after another."""

    name: str = ""

    def __init__(self, ctx: EnvironmentContext):
        self.ctx = ctx
        self.settings = ctx.settings

    @abstractmethod
    def reset(self, row: Row) -> Messages:
        """The conversation's first messages for a data row (the prompt as chat messages)."""

    @abstractmethod
    def step(self, messages: Messages, row: Row) -> StepResult:
        """The environment's reply to the conversation so far (whose last message is the
        model's turn)."""

    def step_batch(self, items: Sequence[tuple[Messages, Row]]) -> list[StepResult]:
        """step() for several conversations; environments whose steps wait (tools) override it
        to overlap them (and attribute their errors to a row with `attributed`)."""
        return [attributed(self, row, "step", functools.partial(self.step, messages, row)) for messages, row in items]

    def tools(self) -> list[dict[str, Any]] | None:
        """The tools' schemas as chat templates take them (`tools=`), or None without tools."""
        return None

    def close(self) -> None:  # noqa: B027  (a no-op by default: most environments hold nothing)
        """Release what the environment holds (worker pools, sandboxes)."""

    @property
    def label(self) -> str:
        return self.settings.environment if self.settings is not None else self.name


def short_row(row: Row, limit: int = 160) -> str:
    text = repr(row)
    return text if len(text) <= limit else text[: limit - 3] + "..."


T = TypeVar("T")


def attributed(env: Environment, row: Row, what: str, fn: Callable[[], T]) -> T:
    """fn(), with any exception turned into an EnvironmentStepError naming env and row."""
    try:
        return fn()
    except EnvironmentStepError:
        raise
    except Exception as e:
        raise EnvironmentStepError(f"environment {env.label!r}: {what} raised {type(e).__name__}: {e} "
                                   f"(data row {short_row(row)})") from e


def check_messages(env: Environment, row: Row, what: str, messages: Any) -> Messages:
    def bad(problem: str) -> EnvironmentStepError:
        return EnvironmentStepError(f"environment {env.label!r}: {what} returned {problem} "
                                    f"(data row {short_row(row)})")
    if not isinstance(messages, list):
        raise bad(f"{type(messages).__name__} for its messages, not a list of message dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise bad(f"message {i} {m!r}: each message needs a 'role' in {', '.join(ROLES)} "
                      "and a string 'content'")
    return messages


def check_result(env: Environment, row: Row, result: Any) -> StepResult:
    if not isinstance(result, StepResult):
        raise EnvironmentStepError(f"environment {env.label!r}: step returned {type(result).__name__}, "
                                   f"not a StepResult (data row {short_row(row)})")
    check_messages(env, row, "step", result.messages)
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvironmentStepError(f"environment {env.label!r}: step returned reward {reward!r}; rewards "
                                   f"must be finite numbers (data row {short_row(row)})")
    return result


def checked_reset(env: Environment, row: Row) -> Messages:
    """env.reset(row), checked; errors name the environment and the row."""
    messages = attributed(env, row, "reset", lambda: env.reset(row))
    messages = check_messages(env, row, "reset", messages)
    if not messages:
        raise EnvironmentStepError(f"environment {env.label!r}: reset returned no messages "
                                   f"(data row {short_row(row)})")
    return messages


def step_all(env: Environment, items: Sequence[tuple[Messages, Row]]) -> list[StepResult]:
    """env.step_batch(items), each result checked; an environment that raises or returns
    something malformed stops with an EnvironmentStepError naming it and the row (for a batch
    that raises as a whole, its first row, as the batch cannot say which one)."""
    if not items:
        return []
    results = attributed(env, items[0][1], "step", lambda: env.step_batch(items))
    if not isinstance(results, list) or len(results) != len(items):
        raise EnvironmentStepError(f"environment {env.label!r}: step_batch returned "
                                   f"{type(results).__name__} for {len(items)} conversations; it must "
                                   f"return one StepResult per conversation (data row {short_row(items[0][1])})")
    return [check_result(env, row, r) for (_, row), r in zip(items, results)]
