"""The single-turn rule reward as an environment: the prompt, one model turn, its rule reward.

The reward is what the run's RuleReward gives the response text (`fn(response, prompt,
**fields)`), so a run with environment 'rule' scores exactly as the single-turn loop does.
"""

from __future__ import annotations

from slurm_align.environments.base import Environment, EnvironmentContext, Messages, Row, StepResult
from slurm_align.rewards.rule import RuleReward


def first_messages(row: Row, prompt_key: str) -> Messages:
    """A chat row's messages, or the prompt text as one user turn."""
    if isinstance(row.get("messages"), list):
        return [dict(m) for m in row["messages"]]
    return [{"role": "user", "content": str(row[prompt_key])}]


def last_model_text(messages: Messages) -> str:
    """The content of the conversation's last message, which must be the model's turn."""
    if not messages or messages[-1].get("role") != "assistant":
        got = messages[-1].get("role") if messages else "no messages"
        raise ValueError(f"step needs the model's turn (role 'assistant') last; got {got!r}")
    return messages[-1]["content"]


class RuleEnvironment(Environment):
    """One turn: the reward is the rule reward of the response; the conversation ends."""

    name = "rule"

    def __init__(self, ctx: EnvironmentContext):
        super().__init__(ctx)
        if ctx.reward_rule is None:
            raise ValueError("environment 'rule' needs a rule reward (reward.rule, 'module:function')")
        self.rule = RuleReward.load(ctx.reward_rule)

    def reset(self, row: Row) -> Messages:
        return first_messages(row, self.ctx.prompt_key)

    def score(self, response: str, row: Row) -> float:
        key = self.ctx.prompt_key
        return self.rule(response, str(row[key]), {k: v for k, v in row.items() if k != key})

    def step(self, messages: Messages, row: Row) -> StepResult:
        return StepResult(messages=[], reward=self.score(last_model_text(messages), row), done=True)
