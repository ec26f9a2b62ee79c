"""DAPO's dynamic sampling and overlong reward shaping in the rollout collector: the step fills
with groups whose rewards differ, stops at its cap, keeps its samples labelled as one round's;
the length penalty equals its formula.

A FAKE engine (test_rollout_collector's recording engine) whose answers are set per prompt: two
prompts are always answered right, one always wrong (their groups' rewards are all equal), the
other two right or wrong by the sample's seed (their groups' rewards differ). Everything else is
real: the prompt server over MPI.COMM_SELF, the tokenizer, the data set, the sort rule reward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align.algorithms.rollout_collector import overlong_penalty, varied_groups
from slurm_align.config import RunConfig
from slurm_align.rewards.sort import target
from tests.support.single_rank import mpi
from tests.unit.algorithms.test_rollout_collector import PROMPTS, K, RecordingEngine, data, layout, make_run, setup

__all__ = ["data"]   # the prompts-file fixture, shared with the collector's tests

ALWAYS_RIGHT, ALWAYS_WRONG = {"1068=", "9213="}, {"5570="}


class PromptEngine(RecordingEngine):
    @staticmethod
    def answer(prompt_text: str, seed: int) -> tuple[str, bool]:
        digits = "".join(c for c in prompt_text if c.isdigit())
        right = prompt_text in ALWAYS_RIGHT or (prompt_text not in ALWAYS_WRONG and seed % 2 == 0)
        return (target(prompt_text) if right else digits + "0"), True


def collect(run: RunConfig, data: Path):
    s = setup(run, data, critic=False)
    s.collector.engine = PromptEngine(s.engine.tok, s.log)
    return s.collector.collect(1, mpi().COMM_SELF, layout())


def dapo(rounds: int, **over) -> RunConfig:
    return make_run(rl={"filter_equal_reward_groups": True, "dynamic_sampling_max_rounds": rounds}, **over)


def test_rounds_fill_the_step_with_varied_groups(data: Path):
    n = len(PROMPTS)
    plain = collect(make_run(rl={"filter_equal_reward_groups": True}), data)
    assert sum(varied_groups(plain.batch).values()) == 2, "one round: only the two seed-decided prompts vary"
    got = collect(dapo(5), data)
    batch = got.batch
    assert batch.size == n * K
    assert sorted(batch["index"].tolist()) == list(range(n * K)), "labelled as one round's samples"
    assert sorted(set(batch["group"].tolist())) == list(range(n))
    assert all(varied_groups(batch).values()), "every kept group's rewards differ"
    assert got.metrics["dynamic_sampling_rounds"] == 3 and got.metrics["kept_varied_groups"] == n
    assert got.metrics["dropped_equal_groups"] == 3 * 3 and got.metrics["kept_equal_groups"] == 0
    assert got.metrics["dropped_varied_groups"] == 1, "3 rounds gave 6 varied groups for 5 slots"
    # each group answers one prompt, and only the seed-decided prompts are kept
    prompts = {int(g): tuple(batch.tokens[i, 1:int(batch.prompt_lengths[i])].tolist())
               for i, g in enumerate(batch["group"].tolist())}
    texts = {bytes(p).decode() for p in prompts.values()}
    assert texts <= set(PROMPTS) - ALWAYS_RIGHT - ALWAYS_WRONG


def test_the_cap_stops_the_rounds_and_equal_groups_fill_the_rest(data: Path):
    got = collect(dapo(1), data)
    assert got.batch.size == len(PROMPTS) * K
    assert got.metrics["dynamic_sampling_rounds"] == 2
    assert got.metrics["kept_varied_groups"] == 4 and got.metrics["kept_equal_groups"] == 1
    assert got.metrics["dropped_equal_groups"] == 2 * 3 - 1
    assert sum(varied_groups(got.batch).values()) == 4


def test_dynamic_sampling_needs_the_filter_a_rule_and_no_critic():
    with pytest.raises(ValueError, match="filter_equal_reward_groups is off"):
        make_run(rl={"dynamic_sampling_max_rounds": 2})
    with pytest.raises(ValueError, match="critic"):
        make_run(reward={"model": True}, rl={"filter_equal_reward_groups": True,
                                             "dynamic_sampling_max_rounds": 2})


def test_overlong_penalty_is_dapos_formula():
    # max 8 new tokens, the last 4 penalised: 0 up to 4 tokens, then (4 - length) / 4
    got = overlong_penalty(np.array([0, 3, 4, 5, 6, 7, 8]), max_new_tokens=8, buffer=4, factor=1.0)
    assert got.tolist() == [0, 0, 0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(np.array([6]), 8, 4, factor=0.5).tolist() == [-0.25]
    with pytest.raises(ValueError, match="overlong_buffer=8"):
        make_run(rl={"overlong_buffer": 8})


def test_overlong_shaping_adds_to_the_rule_reward(data: Path):
    run = make_run(rl={"overlong_buffer": 4}, generation={"max_new_tokens": 8})
    got = collect(run, data).batch
    lengths = got.response_lengths.numpy()
    plain = collect(make_run(generation={"max_new_tokens": 8}), data).batch
    assert torch.equal(plain["index"], got["index"])
    want = plain["rule_reward"].numpy() + overlong_penalty(lengths, 8, 4)
    assert np.allclose(got["rule_reward"].numpy(), want)
    assert (lengths > 4).any(), "some answers reach into the penalised tokens"
