"""Write the small-arithmetic task's JSONL files (see README.md).

    python examples/arithmetic/generate.py [--seed 0] [--out examples/arithmetic] [--max-operand 99]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SIZES = {"sft_train": 2000, "sft_val": 200, "prompts": 1000, "prompts_val": 200}


def problem(rng: random.Random, max_operand: int = 99) -> tuple[str, str]:
    """'a+b=' or 'a-b=' with a, b in 0..max_operand (a >= b for '-', so answers are never negative)."""
    a, b = rng.randrange(max_operand + 1), rng.randrange(max_operand + 1)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}=", str(a - b)


def rows(kind: str, rng: random.Random, n: int, max_operand: int = 99) -> list[dict]:
    out = []
    for _ in range(n):
        prompt, answer = problem(rng, max_operand)
        out.append({"input": prompt, "output": answer} if kind == "sft" else {"prompt": prompt, "answer": answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--max-operand", type=int, default=99, choices=range(1, 1000), metavar="1..999",
                    help="largest operand (9: the one-digit task a tiny model learns in minutes)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (name, n) in enumerate(SIZES.items()):
        rng = random.Random(args.seed * 1000 + i)  # one stream per file: files are independent
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(name.split("_")[0], rng, n, args.max_operand)))
        print(f"wrote {path} ({n} lines)")


if __name__ == "__main__":
    main()
