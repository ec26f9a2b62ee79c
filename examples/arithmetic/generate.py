"""Write the small-arithmetic task's JSONL files (see README.md).

    python examples/arithmetic/generate.py [--seed 0] [--out examples/arithmetic]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SIZES = {"sft_train": 2000, "sft_val": 200, "prompts": 1000, "prompts_val": 200}


def problem(rng: random.Random) -> tuple[str, str]:
    """'a+b=' or 'a-b=' with a, b in 0..99 (a >= b for '-', so answers are never negative)."""
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        return f"{a}+{b}=", str(a + b)
    a, b = max(a, b), min(a, b)
    return f"{a}-{b}=", str(a - b)


def rows(kind: str, rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        prompt, answer = problem(rng)
        out.append({"input": prompt, "output": answer} if kind == "sft" else {"prompt": prompt, "answer": answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    for i, (name, n) in enumerate(SIZES.items()):
        rng = random.Random(args.seed * 1000 + i)  # one stream per file: files are independent
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(name.split("_")[0], rng, n)))
        print(f"wrote {path} ({n} lines)")


if __name__ == "__main__":
    main()
