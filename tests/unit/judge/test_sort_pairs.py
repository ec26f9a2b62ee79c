"""The sort judge's training pairs drawn from a policy's own samples (judge/sort_pairs.py): labelled
by the rule, the right answer against each wrong sample, rows over the context left out;
its prompts avoid the files named; near-miss pairs put the right answer against one edit of it;
the auxiliary rows write the right answer, after the prompt or after a first answer; none of them
on the prompts excluded."""

from __future__ import annotations

import json
import random

from slurm_align.judge.sort_pairs import (
    judge_prompt_rows,
    near_miss,
    near_miss_rows,
    policy_pair_rows,
    sort_demo_rows,
)
from slurm_align.rewards.sort import exact, partial


def test_policy_pairs_are_the_rules_verdicts_on_the_samples_and_the_right_answer():
    samples = {"41672=": ["12466", "21467", "12466"], "90=": ["09", "09"]}
    rows = policy_pair_rows(samples, random.Random(0))
    seen = set()
    for r in rows:
        prompt, rest = r["input"].split("=", 1)
        a, b = rest.removesuffix("?").split("|")
        assert r["output"] == ("A" if partial(a, prompt + "=") > partial(b, prompt + "=") else "B")
        seen.add(frozenset((a, b)))
    # 41672: the right 12467 against 12466 and 21467; 90: only the right answer -> none
    assert seen == {frozenset(p) for p in (("12466", "12467"), ("12467", "21467"))}
    wide = "\ufffd" * 9          # 27 bytes: over the judge's 32-token context with the prompt and the answer
    assert policy_pair_rows({"41672=": [wide]}, random.Random(0)) == []


def test_judge_prompts_avoid_the_files_named(tmp_path):
    taken = [r["prompt"] for r in judge_prompt_rows(50, [])]
    f = tmp_path / "seen.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in taken[:25]))
    assert not set(taken[:25]) & {r["prompt"] for r in judge_prompt_rows(50, [f])}


def _edits(a: str, b: str) -> int:
    """Levenshtein distance, adjacent swaps counting 1."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def test_near_misses_are_wrong_answers_close_to_the_right_one_and_labelled_for_it():
    rng = random.Random(0)
    misses = [near_miss(rng, "12467") for _ in range(300)]
    assert all(m != "12467" and m.isdigit() for m in misses)
    # one digit replaced (sorted again: up to 2 edits), repeated, dropped, or two neighbours swapped
    assert all(_edits(m, "12467") <= 2 for m in misses)
    assert {len(m) for m in misses} == {4, 5, 6}
    assert sum(m == "".join(sorted(m)) and len(m) == 5 for m in misses) > 50   # the policy's commonest error
    rows = near_miss_rows(random.Random(1), 200)
    for r in rows:
        prompt, rest = r["input"].split("=", 1)
        a, b = rest.removesuffix("?").split("|")
        assert exact(a if r["output"] == "A" else b, prompt + "=") == 1.0
        assert exact(b if r["output"] == "A" else a, prompt + "=") == 0.0
    assert 60 < sum(r["output"] == "A" for r in rows) < 140    # the right answer in either place


def test_demo_rows_write_the_right_answer_where_the_answers_stand_and_avoid_the_prompts_excluded():
    from slurm_align.rewards.sort import target

    rows = sort_demo_rows(random.Random(2), 400)
    after_prompt = [r for r in rows if r["input"].endswith("=")]
    after_first = [r for r in rows if r["input"].endswith("|")]
    assert len(after_prompt) == len(after_first) == 200
    for r in rows:
        prompt = r["input"].split("=", 1)[0] + "="
        assert r["output"] == target(prompt)
    firsts = [r["input"].split("=", 1)[1].removesuffix("|") for r in after_first]
    assert 50 < sum(f == target(r["input"].split("=", 1)[0] + "=") for f, r in zip(firsts, after_first)) < 150
    # 4-digit prompts are a quarter of the task's and only 10,000: excluded ones must not come back
    four = frozenset(f"{i:04d}=" for i in range(10_000) if i % 10)
    for got in (sort_demo_rows(random.Random(3), 300, seen=four), near_miss_rows(random.Random(3), 300, seen=four)):
        prompts = {r["input"].split("=", 1)[0] + "=" for r in got}
        assert not prompts & four
        assert any(len(p) == 5 for p in prompts)          # the 4-digit prompts left (ending in 0) still drawn
