"""The environment interface, its registry and settings, and the rule reward as an environment."""

from __future__ import annotations

import pytest

from slurm_align.config.errors import ConfigError
from slurm_align.environments.base import (
    Environment,
    EnvironmentContext,
    EnvironmentStepError,
    StepResult,
    checked_reset,
    step_all,
)
from slurm_align.environments.config import EnvironmentConfig, check_against_run, parse_environment_config
from slurm_align.environments.registry import environment_names, load_environment, register_environment
from slurm_align.environments.rule_env import RuleEnvironment
from slurm_align.rewards.rule import RuleReward

RULE = "slurm_align.rewards.arithmetic:exact_answer"


def ctx(rule: str | None = RULE, **settings) -> EnvironmentContext:
    return EnvironmentContext(EnvironmentConfig(**settings), reward_rule=rule)


class Echo(Environment):
    """A two-turn environment: replies once as the user, then ends with reward = turns seen."""

    name = "echo_test"

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, row):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns == 1:
            return StepResult([{"role": "user", "content": "again"}], reward=0.5)
        return StepResult([], reward=float(turns), done=True, metrics={"turns": turns})


class Raises(Environment):
    name = "raises_test"

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, row):
        if row["prompt"] == "bad":
            raise KeyError("no_such_field")
        return StepResult([], reward=1.0, done=True)


class ReturnsNan(Raises):
    name = "nan_test"

    def step(self, messages, row):
        return StepResult([], reward=float("nan") if row["prompt"] == "bad" else 1.0, done=True)


class BadMessages(Raises):
    name = "badmsg_test"

    def step(self, messages, row):
        return StepResult([{"role": "robot" if row["prompt"] == "bad" else "user", "content": "x"}], done=True)


def test_rule_environment_scores_as_the_rule_reward():
    env = load_environment(ctx())
    assert isinstance(env, RuleEnvironment)
    rows = [{"prompt": "3+4*2=", "answer": "11"}, {"prompt": "1+1=", "answer": "2"}]
    rule = RuleReward.load(RULE)
    for response in ("11", " 2\n", "12"):
        convs = [([*checked_reset(env, row), {"role": "assistant", "content": response}], row) for row in rows]
        results = step_all(env, convs)
        assert [r.reward for r in results] == rule.many([response] * 2, rows)
        assert all(r.done and r.messages == [] for r in results)
    # a chat row's own messages start the conversation
    chat = {"prompt": "q", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
            "answer": "4"}
    assert checked_reset(env, chat) == chat["messages"] and checked_reset(env, chat) is not chat["messages"]


def test_rule_environment_needs_a_rule_and_the_models_turn():
    with pytest.raises(ValueError, match="needs a rule reward"):
        load_environment(ctx(rule=None))
    env = load_environment(ctx())
    row = {"prompt": "1+1=", "answer": "2"}
    with pytest.raises(EnvironmentStepError, match=r"environment 'rule': step raised ValueError: .*role 'assistant'"):
        step_all(env, [(checked_reset(env, row), row)])


def test_registry_by_name_and_module_class():
    assert {"rule", "tools"} <= set(environment_names())
    register_environment(Echo)
    assert "echo_test" in environment_names()
    for spec in ("echo_test", "tests.unit.environments.test_registry:Echo"):
        env = load_environment(ctx(environment=spec))
        row = {"prompt": "hi"}
        conv = [*checked_reset(env, row), {"role": "assistant", "content": "a"}]
        [first] = step_all(env, [(conv, row)])
        assert first.messages == [{"role": "user", "content": "again"}] and not first.done
        [second] = step_all(env, [(conv + first.messages + [{"role": "assistant", "content": "b"}], row)])
        assert second.done and second.reward == 2.0 and second.metrics == {"turns": 2}
    with pytest.raises(ValueError, match="is taken"):
        register_environment(type("Other", (Echo,), {"name": "echo_test"}))
    with pytest.raises(TypeError, match="must subclass Environment"):
        register_environment(object)


@pytest.mark.parametrize("spec,match", [
    ("no_such_env", r"got 'no_such_env'; unknown environment; registered: .*rule.*tools"),
    ("slurm_align.no_such_module:Env", r"cannot import module 'slurm_align.no_such_module'"),
    ("tests.unit.environments.test_registry:ctx", r"has no Environment subclass 'ctx'"),
    ("tests.unit.environments.test_registry:Nope", r"has no Environment subclass 'Nope'"),
])
def test_load_errors_name_the_spec_and_list_the_names(spec, match):
    settings = EnvironmentConfig.model_construct(environment=spec)   # past the config's own check
    with pytest.raises(ConfigError, match=match) as e:
        load_environment(EnvironmentContext(settings, reward_rule=RULE))
    assert "environment.environment" in str(e.value)


def test_step_errors_name_the_environment_and_the_row():
    for env_cls, match in [(Raises, r"environment 'tests.unit.environments.test_registry:Raises': "
                                    r"step raised KeyError: 'no_such_field' \(data row \{'prompt': 'bad'\}\)"),
                           (ReturnsNan, r"returned reward nan; rewards must be finite"),
                           (BadMessages, r"message 0 .*'robot'.*needs a 'role' in system, user, assistant, tool")]:
        env = load_environment(ctx(environment=f"tests.unit.environments.test_registry:{env_cls.__name__}"))
        rows = [{"prompt": "good"}, {"prompt": "bad"}]
        convs = [([*checked_reset(env, r), {"role": "assistant", "content": "x"}], r) for r in rows]
        with pytest.raises(EnvironmentStepError, match=match) as e:
            step_all(env, convs)
        assert "'prompt': 'bad'" in str(e.value)


def test_settings_defaults_and_errors():
    s = EnvironmentConfig()
    assert (s.environment, s.max_turns, s.stop_sequences, s.tools) == ("rule", 1, ["</tool_call>"], [])
    assert all(f.description for f in EnvironmentConfig.model_fields.values())   # a docstring per field
    cases = [
        ({"environment": "nope"}, r"environment.environment.*unknown environment 'nope'; registered: .*rule"),
        ({"environment": "a b:C"}, r"environment.environment.*is not 'module:Class'"),
        ({"max_turns": 0}, r"environment.max_turns': got 0"),
        ({"stop_sequences": ["</tool_call>", ""]}, r"stop sequence must not be empty"),
        ({"stop_sequences": ["x", "x"]}, r"stop sequences repeated: \['x'\]"),
        ({"max_turn_tokens": 64, "max_total_tokens": 32}, r"max_turn_tokens=64 exceeds max_total_tokens=32"),
        ({"max_turns": 1, "bogus": 1}, r"environment.bogus': .*unknown key"),
    ]
    for data, match in cases:
        with pytest.raises(ConfigError, match=match):
            parse_environment_config(data, source="run.yaml")
    assert check_against_run(EnvironmentConfig(max_total_tokens=128), max_seq_len=128, reward_rule=RULE) == [
        "field 'environment.max_total_tokens': got 128; must be less than model.max_seq_len=128 "
        "(the prompt needs room too)"]
    assert check_against_run(EnvironmentConfig(max_total_tokens=100, max_turn_tokens=50), 128, RULE) == []
    assert check_against_run(EnvironmentConfig(), 128, None) == [
        "field 'environment.environment': got 'rule'; it scores answers with reward.rule, which is not set "
        "(give reward.rule 'module:function')"]
    echo = EnvironmentConfig(environment="tests.unit.environments.test_registry:Echo")
    assert check_against_run(echo, 128, None) == []


def test_run_config_environment_field():
    from slurm_align.config.loading import validate
    from slurm_align.config.run import RunConfig
    base = {"algorithm": "grpo", "rl": {"n_samples_per_prompt": 2}, "reward": {"rule": RULE}}
    assert not validate(RunConfig, base, "run.yaml").multi_turn      # the default: single-turn rule reward
    run = validate(RunConfig, {**base, "environment": {"environment": "tools", "tools": ["calculator"],
                                                       "max_turns": 3, "max_turn_tokens": 16}}, "run.yaml")
    assert run.multi_turn and run.environment.max_turn_tokens == 16
    assert RunConfig.model_fields["environment"].description
    cases = [({"max_turns": 0}, r"run.yaml: field 'environment.max_turns': got 0"),
             ({"environment": "nope"}, r"field 'environment.environment': got 'nope'; .*unknown environment"),
             ({"max_turns": 2, "max_total_tokens": 500},
              r"run.yaml: field 'environment.max_total_tokens': got 500; must be less than model.max_seq_len=128")]
    for env, match in cases:
        with pytest.raises(ConfigError, match=match):
            validate(RunConfig, {**base, "environment": env}, "run.yaml")
    with pytest.raises(ConfigError, match=r"field 'environment.environment': multi-turn rollouts with a "
                                          r"reward model \(reward.model\): not built yet"):
        validate(RunConfig, {**base, "reward": {"rule": RULE, "model": True}, "environment": {"max_turns": 2}},
                 "run.yaml")
    # disaggregated multi-turn is built (tests/integration/test_multiturn.py runs it)
    assert validate(RunConfig, {**base, "rollout": {"mode": "disaggregated"}, "environment": {"max_turns": 2}},
                    "run.yaml").multi_turn
    # generation replicas of several ranks are not: the actor's when colocated, the generator's when not
    tp2 = {"tensor_parallel": 2, "data_parallel": 1}
    for extra, field in [({"actor": tp2}, "actor"),
                         ({"rollout": {"mode": "disaggregated"}, "generation": {"engine": "trtllm"},
                           "generator": tp2}, "generator")]:
        with pytest.raises(ConfigError, match=rf"field '{field}.tensor_parallel': got 2; multi-turn"):
            validate(RunConfig, {**base, **extra, "environment": {"max_turns": 2}}, "run.yaml")
    assert validate(RunConfig, {**base, "actor": tp2, "rollout": {"mode": "disaggregated"},
                                "environment": {"max_turns": 2}}, "run.yaml").multi_turn   # a TP 2 trainer
