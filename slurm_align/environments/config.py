"""Environment settings of a run: which environment, how long a conversation may go, what ends a
model turn, which tools it has.

Ready to become RunConfig's `environment` field (`environment: EnvironmentConfig =
EnvironmentConfig()`); errors then read "field 'environment.max_turns': ...". Until it is wired
in, `EnvironmentConfig.model_validate(data)` (or `parse_environment_config`) checks a mapping the
same way. The defaults are the single-turn rule reward: one model turn, scored by reward.rule.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic
from pydantic import Field, field_validator, model_validator

from slurm_align.config.base import StrictModel
from slurm_align.config.errors import ConfigError

SPEC_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class EnvironmentConfig(StrictModel):
    """What a rollout's conversation talks to between the model's turns."""

    environment: str = "rule"
    """A registered environment ('rule': one turn scored by reward.rule; 'tools': the model
    calls tools until it answers, the answer scored by reward.rule) or a user class given as
    'module:Class' (a subclass of slurm_align.environments.base.Environment). Default 'rule'."""
    max_turns: int = Field(1, ge=1, le=1024)
    """Most model turns in one conversation; at the last one the environment ends it (a tool
    environment scores the turn as the answer). Default 1 (single-turn)."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Most tokens the model generates in one turn. Default: generation.max_new_tokens."""
    max_total_tokens: int | None = Field(None, ge=1)
    """Most tokens after the prompt in one conversation, the model's and the environment's
    together (tool outputs count: they take context); a conversation that reaches it ends,
    truncated. Default: model.max_seq_len less the prompt."""
    stop_sequences: list[str] = Field(default_factory=lambda: ["</tool_call>"])
    """Texts that end a model turn besides the end-of-sequence token; the tool-call parser reads
    a turn the same whether the engine keeps the stop text or drops it. Default
    ["</tool_call>"], the end of a tool call block."""
    tools: list[str] = Field(default_factory=list)
    """Tools the model may call (tool environment): built-in 'calculator' or 'python', or
    'module:name' of a slurm_align.environments.tools.Tool instance or class. Default none."""
    tool_timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall-clock limit of one tool call, counted from when it starts running; a call that
    exceeds it gets an error observation. Default 10 s."""
    tool_workers: int = Field(4, ge=1, le=256)
    """Threads running tool calls on each generating rank, so that a slow call does not hold up
    the other conversations' calls. Default 4."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Free-form settings for a user environment class (read from ctx.settings.options)."""

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, value: str) -> str:
        # deferred: the registry imports the built-in environments, which import this module
        from slurm_align.environments.registry import environment_names
        if ":" in value:
            if not _matches(value):
                raise ValueError(f"{value!r} is not 'module:Class' (e.g. 'my_pkg.envs:Maze')")
            return value
        names = environment_names()
        if value not in names:
            raise ValueError(f"unknown environment {value!r}; registered: {', '.join(names)} "
                             "(or a user class as 'module:Class')")
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stop_sequences(cls, value: list[str]) -> list[str]:
        for s in value:
            if not s:
                raise ValueError("a stop sequence must not be empty (it would end every turn at once)")
        if len(set(value)) != len(value):
            dups = sorted({s for s in value if value.count(s) > 1})
            raise ValueError(f"stop sequences repeated: {dups}")
        return value

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        from slurm_align.environments.tools import BUILTIN_TOOLS
        for name in value:
            if ":" in name:
                if not _matches(name):
                    raise ValueError(f"tool {name!r} is not 'module:name' (e.g. 'my_pkg.tools:search')")
            elif name not in BUILTIN_TOOLS:
                raise ValueError(f"unknown tool {name!r}; built-in: {', '.join(sorted(BUILTIN_TOOLS))} "
                                 "(or a user tool as 'module:name')")
        if len(set(value)) != len(value):
            raise ValueError(f"tools repeated: {sorted({t for t in value if value.count(t) > 1})}")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.max_turn_tokens and self.max_total_tokens and self.max_turn_tokens > self.max_total_tokens:
            raise ValueError(f"max_turn_tokens={self.max_turn_tokens} exceeds max_total_tokens="
                             f"{self.max_total_tokens}: a turn could never use its budget")
        if self.environment == "tools" and not self.tools:
            raise ValueError("environment 'tools' needs at least one tool in 'tools' "
                             "(built-in: calculator, python)")
        if self.tools and self.max_turns < 2:
            raise ValueError(f"tools {self.tools} with max_turns={self.max_turns}: the model could call a "
                             "tool but never read its answer; give max_turns >= 2")
        return self


def _matches(value: str) -> bool:
    return re.match(SPEC_PATTERN, value) is not None


def parse_environment_config(data: Any, source: str | None = None, prefix: str = "environment") -> EnvironmentConfig:
    """The settings from a mapping, bad input as a ConfigError naming the field ('environment.x')."""
    try:
        return EnvironmentConfig.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, source, prefix=prefix) from None


def check_against_run(cfg: EnvironmentConfig, max_seq_len: int, reward_rule: str | None) -> list[str]:
    """Problems of the settings against the rest of the run (RunConfig's cross-checks once wired):
    budgets at or past model.max_seq_len can never be used; the built-in environments score
    answers with reward.rule, so they need one."""
    problems = []
    if cfg.max_total_tokens is not None and cfg.max_total_tokens >= max_seq_len:
        problems.append(f"field 'environment.max_total_tokens': got {cfg.max_total_tokens}; must be less "
                        f"than model.max_seq_len={max_seq_len} (the prompt needs room too)")
    if cfg.max_turn_tokens is not None and cfg.max_turn_tokens >= max_seq_len:
        problems.append(f"field 'environment.max_turn_tokens': got {cfg.max_turn_tokens}; must be less "
                        f"than model.max_seq_len={max_seq_len}")
    if cfg.environment in ("rule", "tools") and reward_rule is None:
        problems.append(f"field 'environment.environment': got {cfg.environment!r}; it scores answers with "
                        "reward.rule, which is not set (give reward.rule 'module:function')")
    return problems
