"""Sampled evaluation's arithmetic (algorithms/evaluation.py): the unbiased pass@k estimator
against counting subsets, the k reported, a prompt's row and the metrics over rows."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from slurm_align.algorithms.evaluation import pass_at_k, pass_ks, prompt_summary, sampled_metrics
from slurm_align.config import ConfigError, load_run_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo_tiny.yaml"


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8), (10, 0), (10, 9)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_answer(n: int, c: int):
    answers = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(answers, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_reported_ks_are_powers_of_two_and_n():
    assert pass_ks(1) == [1]
    assert pass_ks(8) == [1, 2, 4, 8]
    assert pass_ks(6) == [1, 2, 4, 6]


def test_a_prompt_row_holds_every_sample_and_the_majority_answer():
    row = prompt_summary(3, "31=", ["13", " 31", "13 ", "x"], [1.0, 0.0, 1.0, 0.0])
    assert (row["index"], row["n"], row["num_correct"]) == (3, 4, 2)
    assert (row["response"], row["correct"]) == ("13", 1), "'13' is given twice: the majority"
    assert row["pass@1"] == 0.5 and row["pass@4"] == 1.0
    assert [s["score"] for s in row["samples"]] == [1.0, 0.0, 1.0, 0.0]
    other = prompt_summary(4, "21=", ["21", "21", "12", "x"], [0.0, 0.0, 1.0, 0.0])
    metrics = sampled_metrics([row, other])
    assert metrics["val/pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["val/majority"] == 0.5 and metrics["val/score"] == pytest.approx(3 / 8)


def test_samples_without_temperature_are_refused():
    with pytest.raises(ConfigError, match=r"eval\.temperature"):
        load_run_config(EXAMPLE, ["eval.samples=4"])
    assert load_run_config(EXAMPLE, ["eval.samples=4", "eval.temperature=1.0"]).eval.samples == 4
