"""Write the small-arithmetic task's JSONL files (see README.md).

    python examples/arithmetic/generate.py [--seed 0] [--out examples/arithmetic] [--max-operand 99]

The held-out problems (prompts_val.jsonl, and sft_val.jsonl in SFT form) are drawn first, with
distinct prompts; no training row (sft_train, prompts) has one of their prompts
(slurm_align/data/heldout.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from slurm_align.data.heldout import Problem, distinct, outside

SIZES = {"sft_train": 2000, "sft_val": 200, "prompts": 1000, "prompts_val": 200}
"""Rows per file; the held-out files hold at most a third of the task's distinct prompts (trained
on the other two thirds, the tiny model's SFT policy answers unseen one-digit prompts: measured
0.37 held-out after 400 SFT steps; trained on half, 0.065)."""


def problem(rng: random.Random, max_operand: int = 99) -> Problem:
    """'a+b=' or 'a-b=' with a, b in 0..max_operand (a >= b for '-', so answers are never negative)."""
    a, b = rng.randrange(max_operand + 1), rng.randrange(max_operand + 1)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}=", str(a - b)


def distinct_prompts(max_operand: int) -> int:
    """How many different prompts the task has: every a+b, and a-b with a >= b."""
    k = max_operand + 1
    return k * k + k * (k + 1) // 2


def row(kind: str, prompt: str, answer: str) -> dict:
    return {"input": prompt, "output": answer} if kind == "sft" else {"prompt": prompt, "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--max-operand", type=int, default=99, choices=range(1, 1000), metavar="1..999",
                    help="largest operand (9: the one-digit task a tiny model learns in minutes)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    streams = {name: random.Random(args.seed * 1000 + i) for i, name in enumerate(SIZES)}   # one per file

    def draw(name: str):
        return lambda: problem(streams[name], args.max_operand)

    # the one-digit task has 155 prompts: 51 held out, the other 104 to train on
    held = distinct(draw("prompts_val"), min(SIZES["prompts_val"], distinct_prompts(args.max_operand) // 3))
    held_prompts = {p for p, _ in held}
    problems = {"sft_train": [outside(draw("sft_train"), held_prompts) for _ in range(SIZES["sft_train"])],
                "sft_val": held,
                "prompts": [outside(draw("prompts"), held_prompts) for _ in range(SIZES["prompts"])],
                "prompts_val": held}
    for name, rows in problems.items():
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row(name.split("_")[0], p, a)) + "\n" for p, a in rows))
        print(f"wrote {path} ({len(rows)} lines)")


if __name__ == "__main__":
    main()
