"""The sort judge's training pairs drawn from a policy's own samples (judge/sort_pairs.py): labelled
by the rule, the right answer against each wrong sample, rows over the context left out;
its prompts avoid the files named."""

from __future__ import annotations

import json
import random

from slurm_align.judge.sort_pairs import judge_prompt_rows, policy_pair_rows
from slurm_align.rewards.sort import partial


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
