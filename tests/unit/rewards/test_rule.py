"""Rule rewards: loading, the checks on every call, and the shipped verifiable rewards."""

import json
import math

import pytest

from slurm_align import REPO_ROOT
from slurm_align.data.synthetic import score
from slurm_align.rewards import arithmetic, sort
from slurm_align.rewards.rule import RuleReward, RuleRewardError


# --- rule functions the tests load by name ("tests.unit.rewards.test_rule:...") ------------------------
def raises(response, prompt, **fields):
    raise KeyError("no_such_field")


def returns_nan(response, prompt, **fields):
    return math.nan


def returns_text(response, prompt, **fields):
    return "1.0"


def length(response, prompt, **fields):
    return len(response) + len(fields.get("answer", ""))


def test_load_and_call_with_the_rows_other_fields():
    fn = RuleReward.load("tests.unit.rewards.test_rule:length")
    assert fn("abc", "p=", {"answer": "12"}) == 5.0
    assert fn.many(["a", "bb"], [{"prompt": "x", "answer": "1"}, {"prompt": "y"}]) == [2.0, 2.0]


@pytest.mark.parametrize("spec,match", [
    ("no_colon", "expected 'module:function'"),
    ("slurm_align.no_such_module:f", "cannot import module 'slurm_align.no_such_module'"),
    ("slurm_align.rewards.sort:nope", "has no function 'nope'"),
])
def test_load_errors_name_the_spec(spec, match):
    with pytest.raises(RuleRewardError, match=match) as e:
        RuleReward.load(spec)
    assert repr(spec) in str(e.value)


@pytest.mark.parametrize("name,match", [
    ("raises", "raised KeyError"), ("returns_nan", "returned nan"),
    ("returns_text", "returned str '1.0', not a number"),
])
def test_bad_results_name_the_function_and_the_prompt(name, match):
    fn = RuleReward.load(f"tests.unit.rewards.test_rule:{name}")
    with pytest.raises(RuleRewardError, match=match) as e:
        fn("4321", "7391=", {})
    assert f"tests.unit.rewards.test_rule:{name}" in str(e.value) and "'7391='" in str(e.value)


def test_sort_rewards():
    assert sort.target("7391=") == "1379"
    assert sort.exact("1379", "7391=") == 1.0 and sort.exact(" 1379\n", "7391=") == 1.0
    assert sort.exact("1397", "7391=") == 0.0 and sort.exact("", "7391=") == 0.0
    assert sort.partial("1379", "7391=") == 1.0
    # only the exact answer reaches the top: sorted subsets, repeats, unsorted all stay <= 0.5
    for wrong in ("137", "1111", "13799", "9731", "abc", ""):
        assert sort.partial(wrong, "7391=") <= 0.5
    assert sort.partial("137", "7391=") > sort.partial("1111", "7391=") > 0.0
    # the task's own scorer agrees that exact answers are perfect
    rows = [json.loads(line) for line in (REPO_ROOT / "examples/synthetic/sft_val.jsonl").read_text().splitlines()]
    assert all(sort.exact(r["output"], r["input"]) == 1.0 and score(r["output"]) == 1.0 for r in rows)


def test_arithmetic_rows_carry_right_answers():
    fn = RuleReward.load("slurm_align.rewards.arithmetic:exact_answer")
    for name in ("prompts.jsonl", "prompts_val.jsonl"):
        rows = [json.loads(line) for line in (REPO_ROOT / "examples/arithmetic" / name).read_text().splitlines()]
        assert rows and all(set(r) == {"prompt", "answer"} for r in rows)
        for r in rows:
            a, op, b = r["prompt"].rstrip("=").partition("+") if "+" in r["prompt"] \
                else r["prompt"].rstrip("=").partition("-")
            assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert fn.many([r["answer"] for r in rows], rows) == [1.0] * len(rows)
    assert arithmetic.exact_answer("12", "5+7=", answer="13") == 0.0
