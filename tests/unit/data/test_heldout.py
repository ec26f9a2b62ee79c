"""Held-out problems drawn distinct, training problems drawn outside them (data/heldout.py)."""

from __future__ import annotations

import random

import pytest

from slurm_align.data.heldout import distinct, outside


def digit_sum(rng: random.Random):
    """A task of 10 x 10 prompts, drawn with repeats."""
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str(a + b)


def test_held_out_prompts_are_distinct_and_training_draws_avoid_them():
    rng = random.Random(0)
    held = distinct(lambda: digit_sum(rng), 40)
    prompts = [p for p, _ in held]
    assert len(prompts) == len(set(prompts)) == 40
    assert all(sum(map(int, p[:-1].split("+"))) == int(a) for p, a in held)   # answers stay with their prompts
    train = [outside(lambda: digit_sum(rng), set(prompts)) for _ in range(500)]
    assert not {p for p, _ in train} & set(prompts)
    assert len({p for p, _ in train}) == 60                    # every other prompt is still drawn


def test_a_task_too_small_is_refused_not_looped_on():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="distinct prompts, not 101: the task has too few"):
        distinct(lambda: digit_sum(rng), 101)
    every = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        outside(lambda: digit_sum(rng), every)
