"""The math-verify answer reward accepts equivalent answers and refuses wrong ones."""

from __future__ import annotations

import pytest

from slurm_align.rewards.math import verified_answer
from slurm_align.rewards.rule import RuleReward

# (response, reference answer, reward)
TABLE = [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),       # boxed fraction = decimal
    ("\\boxed{2/4}", "1/2", 1.0),                               # equivalent fractions
    ("so x = 3/4", "\\frac{3}{4}", 1.0),                        # last expression, LaTeX reference
    ("-1/3", "-\\frac{1}{3}", 1.0),
    ("The answer is 7.", "7", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("first 3 then finally 5", "5", 1.0),                       # the final answer, not the first number
    ("first 3 then finally 5", "3", 0.0),
    ("The answer is 8", "7", 0.0),                              # wrong
    ("\\boxed{1.41}", "\\sqrt{2}", 0.0),                        # close is not equal
    ("\\boxed{\\frac{2}{3}}", "0.5", 0.0),
    ("no answer here", "3", 0.0),                               # nothing to extract
]


@pytest.mark.parametrize("response,answer,want", TABLE)
def test_math_answers_are_compared_as_values(response: str, answer: str, want: float):
    assert verified_answer(response, "p", answer=answer) == want


def test_it_is_a_rule_reward_a_run_names_and_a_missing_reference_is_an_error():
    rule = RuleReward.load("slurm_align.rewards.math:verified_answer")
    assert rule.many(["\\boxed{0.25}", "1/3"], [{"prompt": "q", "answer": "1/4", "id": 3}] * 2) == [1.0, 0.0]
    with pytest.raises(Exception, match="no 'answer' field"):
        rule("\\boxed{1}", "q", {})
