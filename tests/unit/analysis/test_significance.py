"""slurm_align.analysis.significance.py: the exact sign test against hand-computed binomial tails, the
paired counts, the pooling of per-prompt evaluation files, and the rank-sum test on rewards."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from slurm_align.analysis.significance import (
    paired_counts,
    pooled_correct,
    rank_sum_test,
    read_results,
    same_prompts,
    sign_test,
)


@pytest.mark.parametrize("b,c,p", [
    (0, 0, 1.0),                   # nothing changed: no evidence
    (1, 0, 1 / 2),                 # P(X >= 1), X ~ Bin(1, 1/2)
    (3, 0, 1 / 8),                 # P(X = 3), X ~ Bin(3, 1/2)
    (2, 1, 4 / 8),                 # (C(3,2) + C(3,3)) / 8
    (0, 3, 1.0),                   # P(X >= 0)
    (4, 1, 6 / 32),                # (C(5,4) + C(5,5)) / 32
    (8, 2, 56 / 1024),             # (45 + 10 + 1) / 2^10
    (10, 0, 1 / 1024),
    (5, 5, 638 / 1024),            # (252 + 210 + 120 + 45 + 10 + 1) / 2^10
    (15, 5, 21700 / 2 ** 20),      # (15504 + 4845 + 1140 + 190 + 20 + 1) / 2^20
])
def test_sign_test_is_the_binomial_upper_tail(b, c, p):
    assert sign_test(b, c) == p


def test_sign_test_at_the_counts_the_learning_tests_see():
    # Large counts, where a normal approximation would be off in the tail: the exact tail by
    # definition (a sum of 401 integers over 2^400), and the complement P(X >= b) + P(n - X >= c + 1) = 1.
    b, c = 250, 150
    n = b + c
    assert sign_test(b, c) == sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n
    assert 1e-7 < sign_test(b, c) < 1e-6           # z = 5.0: about 3e-7
    assert sign_test(b, c) + sign_test(c + 1, b - 1) == pytest.approx(1.0, abs=1e-15)   # P(X >= b) + P(X < b)
    assert sign_test(1000, 1000) == pytest.approx(0.5 + math.comb(2000, 1000) / 2 ** 2001, rel=1e-12)


@pytest.mark.parametrize("b,c", [(-1, 3), (2.5, 1), (1, "2")])
def test_sign_test_refuses_what_is_not_a_count(b, c):
    with pytest.raises((ValueError, TypeError)):
        sign_test(b, c)


def test_paired_counts_count_the_changed_prompts():
    before = [0, 0, 0, 1, 1, 1, 0, 1]
    after = [1, 1, 0, 1, 0, 1, 1, 1]
    got = paired_counts(before, after)
    assert (got.n, got.before, got.after, got.b, got.c) == (8, 4, 6, 3, 1)
    assert got.acc_before == 0.5 and got.acc_after == 0.75
    assert got.p_better == 5 / 16 and got.p_worse == 15 / 16   # P(Bin(4,1/2) >= 3), >= 1
    assert "b=3" in str(got) and "c=1" in str(got)


@pytest.mark.parametrize("before,after,match", [
    ([0, 1], [0, 1, 1], "same prompts"),
    ([0, 2], [0, 1], "0 \\(wrong\\) or 1"),
])
def test_paired_counts_refuse_unpaired_or_non_binary_outcomes(before, after, match):
    with pytest.raises(ValueError, match=match):
        paired_counts(before, after)


def write_eval(run_dir, step, correct, prompts=None):
    prompts = prompts or [f"{i}{i}{i}{i}=" for i in range(len(correct))]
    folder = run_dir / "eval"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"step_{step}.jsonl").write_text("".join(
        json.dumps({"index": i, "prompt": p, "response": "", "score": float(c), "correct": c}) + "\n"
        for i, (p, c) in enumerate(zip(prompts, correct))))


def test_pooled_correct_is_the_majority_of_the_evaluations(tmp_path):
    write_eval(tmp_path, 40, [1, 1, 0, 0, 1])
    write_eval(tmp_path, 50, [1, 0, 1, 0, 0])
    write_eval(tmp_path, 60, [0, 1, 1, 0, 0])
    assert pooled_correct(tmp_path, [40, 50, 60]).tolist() == [1, 1, 1, 0, 0]
    assert pooled_correct(tmp_path, [60]).tolist() == [0, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="odd number of evaluations"):   # a tie has no majority
        pooled_correct(tmp_path, [40, 50])
    assert read_results(tmp_path, 40)[2] == {"index": 2, "prompt": "2222=", "response": "", "score": 0.0,
                                             "correct": 0}


def test_pooling_or_pairing_other_prompts_is_refused(tmp_path):
    write_eval(tmp_path / "a", 0, [1, 0])
    write_eval(tmp_path / "a", 5, [1, 1])
    write_eval(tmp_path / "a", 10, [1, 0], prompts=["12=", "21="])
    with pytest.raises(ValueError, match="other prompts than step 0's"):
        pooled_correct(tmp_path / "a", [0, 5, 10])
    write_eval(tmp_path / "b", 10, [0, 0])
    assert same_prompts(tmp_path / "a", 0, tmp_path / "b", 10)
    assert not same_prompts(tmp_path / "a", 10, tmp_path / "b", 10)
    with pytest.raises(FileNotFoundError, match=r"no evaluation after step 7 \(this run has \[0, 5, 10\]"):
        read_results(tmp_path / "a", 7)
    assert np.array_equal(pooled_correct(tmp_path / "b", [10]), [0, 0])


def test_rank_sum_counts_the_pairs_and_corrects_for_ties():
    # late 10..29 against early 0..19: late > early in 145 + 200 pairs, 10 ties (10..19 on both
    # sides), so 2U = 2 x 345 + 10. Tie correction: 10 values twice, sum(t^3 - t) = 60:
    # var = 20 x 20 / 12 x (41 - 60 / (40 x 39)); z = (350 - 200 - 0.5) / sqrt(var) = 4.0459.
    got = rank_sum_test(list(range(20)), list(range(10, 30)))
    assert (got.n_early, got.n_late, got.u2) == (20, 20, 700)
    var = 400 / 12 * (41 - 60 / 1560)
    assert got.p_higher == pytest.approx(0.5 * math.erfc((149.5 / math.sqrt(var)) / math.sqrt(2)), rel=1e-12)
    assert got.p_higher == pytest.approx(2.61e-5, rel=1e-2)        # Phi(-4.046), from a normal table
    assert (got.mean_early, got.mean_late) == (9.5, 19.5)


def test_rank_sum_of_two_constant_samples():
    # 0s against 1s: every pair late > early (2U = 800); two tie groups of 20: sum(t^3 - t) = 15960
    got = rank_sum_test([0.0] * 20, [1.0] * 20)
    assert got.u2 == 800
    assert got.p_higher == pytest.approx(0.5 * math.erfc(199.5 / math.sqrt(400 / 12 * (41 - 15960 / 1560))
                                                         / math.sqrt(2)), rel=1e-12)
    assert rank_sum_test([1.0] * 20, [0.0] * 20).p_higher > 0.999999   # the other way round: no evidence
    assert rank_sum_test([2.0] * 20, [2.0] * 25).p_higher == 1.0        # nothing moved


@pytest.mark.parametrize("early,late,match", [
    ([0.0] * 19, [1.0] * 20, "at least 20 values per side"),
    ([0.0] * 20, [float("nan")] * 20, "finite"),
])
def test_rank_sum_refuses_small_or_broken_samples(early, late, match):
    with pytest.raises(ValueError, match=match):
        rank_sum_test(early, late)
