"""Judge training and test data on the synthetic sort task: pairs of answers to one prompt, the
verdict ("A" or "B") the task's rule gives (the higher `rewards.sort.partial`; exact answers score
1), rendered with a pairwise template. The pairs are of the sort the CAI pipeline's policy makes:
the right answer against a corrupted one (shuffled, a digit dropped or added, truncated), and two
different corrupted ones; pairs the rule ties are not drawn.
"""

from __future__ import annotations

import random

from slurm_align.data import synthetic
from slurm_align.judge.prompts import JudgeTemplate, pairwise_prompt
from slurm_align.rewards.sort import partial

SORT_PRINCIPLE = "the answer lists the prompt's digits, all of them, in ascending order"


def rule_pair(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, a, b) with partial(a) != partial(b)."""
    while True:
        prompt, good = synthetic.make_prompt(rng)
        x = good if rng.random() < 0.6 else synthetic.corrupted(rng, good)
        y = synthetic.corrupted(rng, good)
        if partial(x, prompt) == partial(y, prompt):
            continue
        return (prompt, x, y) if rng.random() < 0.5 else (prompt, y, x)


def rule_verdict(prompt: str, a: str, b: str) -> str:
    """'A' when the rule prefers a, else 'B'."""
    return "A" if partial(a, prompt) > partial(b, prompt) else "B"


def judge_sft_rows(rng: random.Random, n: int, template: str = "pairwise_compact") -> list[dict]:
    """SFT rows {"input": judging prompt, "output": verdict} for a judge of the sort task."""
    tpl = JudgeTemplate.get(template)
    rows = []
    for _ in range(n):
        prompt, a, b = rule_pair(rng)
        rows.append({"input": pairwise_prompt(tpl, SORT_PRINCIPLE, prompt, a, b),
                     "output": rule_verdict(prompt, a, b)})
    return rows


def write_judge_data(folder, train: int = 8000, val: int = 200, seed: int = 11) -> None:
    """folder/judge_train.jsonl and judge_val.jsonl (examples/judge_tiny.yaml trains on them)."""
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", judge_sft_rows(random.Random(seed), train)),
                       ("val", judge_sft_rows(random.Random(seed + 1), val))):
        (folder / f"judge_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":   # python -m slurm_align.judge.sort_pairs FOLDER
    import sys

    write_judge_data(sys.argv[1])
