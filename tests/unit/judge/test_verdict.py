"""Judging prompts (Jinja2, StrictUndefined) and verdicts read from answer log-probs or text."""

from __future__ import annotations

import math

import pytest

from slurm_align.judge import verdict as V
from slurm_align.judge.label import label, revise
from slurm_align.judge.prompts import JudgePromptError, JudgeTemplate, pairwise_prompt


def test_templates_render_and_a_missing_field_is_an_error_naming_it():
    tpl = JudgeTemplate.get("pairwise")
    text = pairwise_prompt(tpl, "sorted", "7391=", "1379", "3179")
    assert "Principle: sorted" in text and "Answer A: 1379" in text and text.endswith("Verdict: ")
    assert JudgeTemplate.get("pairwise_compact").render(prompt="7391=", a="1379", b="3179", principle="x") == \
        "7391=1379|3179?"
    with pytest.raises(JudgePromptError, match="'b' is undefined"):
        JudgeTemplate.get("pairwise").render(principle="p", prompt="q", a="1")
    with pytest.raises(JudgePromptError, match="not one of"):
        JudgeTemplate.get("no-such-template")
    assert JudgeTemplate.get("{{ prompt }}!").render(prompt="x") == "x!"


def test_verdicts_from_log_probs_normalise_over_the_allowed_answers():
    assert V.pairwise_from_logprobs({"A": math.log(0.3), "B": math.log(0.1)}) == pytest.approx(0.75)
    assert V.pairwise_from_logprobs({"B": -1.0}) == 0.0            # A absent from a top-k list
    with pytest.raises(V.VerdictError, match="no allowed answer"):
        V.pairwise_from_logprobs({"C": -0.1})
    digits = [str(d) for d in range(10)]
    assert V.pointwise_from_logprobs({"9": 0.0}, digits) == 1.0
    assert V.pointwise_from_logprobs({"0": math.log(0.5), "9": math.log(0.5)}, digits) == pytest.approx(0.5)


def test_verdicts_from_text_take_the_first_allowed_answer_standing_alone():
    assert V.pairwise_from_text("Answer B is better. A is not.") == 0.0
    assert V.pairwise_from_text(" A") == 1.0
    assert V.pointwise_from_text("Score: 7/9", [str(d) for d in range(10)]) == pytest.approx(7 / 9)
    with pytest.raises(V.VerdictError, match="none of the allowed"):
        V.pairwise_from_text("Both are fine")


class RuleJudge:
    """A judge that prefers the sorted answer in a `pairwise_compact` prompt: p(A) = 0.9 or 0.1."""

    def answer_logprobs(self, prompts, answers):
        out = []
        for p in prompts:
            digits, rest = p.split("=", 1)
            a = rest.split("|", 1)[0]
            pa = 0.9 if a == "".join(sorted(digits)) else 0.1
            out.append({"A": math.log(pa), "B": math.log(1 - pa)})
        return out


def test_label_and_revise_pick_what_the_judge_prefers_and_the_controls_ignore_it():
    tpl = JudgeTemplate.get("pairwise_compact")
    samples = {"7391=": ["3179", "1379", "1379"], "52=": ["25", "52"], "9=": ["9", "9"]}
    rows = label(samples, RuleJudge(), tpl, ["sorted"])
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [("7391=", "1379", "3179"), ("52=", "25", "52")]
    assert rows[0]["judge_p"] == pytest.approx(0.9)                # both orders averaged
    revised = revise(samples, RuleJudge(), tpl, ["sorted"])
    assert [(r["input"], r["output"]) for r in revised] == [("7391=", "1379"), ("52=", "25")]
    chosen = {r["chosen"] for s in range(20) for r in label(samples, None, tpl, ["sorted"], random_labels=True, seed=s)}
    assert chosen == {"1379", "3179", "25", "52"}                 # a coin: both sides get chosen
    assert len(revise(samples, None, tpl, ["sorted"], random_choice=True)) == 3


def test_revise_keeps_only_revisions_the_judge_prefers_by_the_margin_asked():
    tpl = JudgeTemplate.get("pairwise_compact")
    samples = {"7391=": ["3179", "1379"], "52=": ["25", "52"]}
    assert len(revise(samples, RuleJudge(), tpl, ["sorted"], min_margin=0.35)) == 2   # wins 0.9 >= 0.85
    assert revise(samples, RuleJudge(), tpl, ["sorted"], min_margin=0.45) == []       # 0.9 < 0.95
