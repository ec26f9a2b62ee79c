"""Write the tool-arithmetic task's JSONL files (see README.md): products of 3-digit numbers, which
a tiny model cannot compute in its head, and SFT answers that call the calculator for them.

    python examples/tool_arithmetic/generate.py [--seed 0] [--out examples/tool_arithmetic]

An SFT answer either calls the calculator (a share --tool-share of them) or gives the product
at once, "in its head", as a model that was never taught the tool would. A calling answer is the
model's turns and the tool's, in the plain format the multi-turn loop writes
(environments/render.py): the call, the calculator's answer, then the product; as a multi-turn
output (segments), so SFT trains the model's turns only. The SFT policy thus calls the tool only
sometimes (its greedy answer mostly not), which leaves GRPO its lesson: the answers that call
the tool are the ones that score.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SIZES = {"sft_train": 4000, "sft_val": 200, "prompts": 1000, "prompts_val": 200}
TOOL_SHARE = 0.3
"""Share of SFT answers that call the calculator; the others answer at once (and are wrong when
the model writes them: it cannot multiply in its head)."""


def problem(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    return f"{a}*{b}=", str(a * b)


def tool_answer(prompt: str, answer: str) -> list[dict]:
    """The model's call, the calculator's reply (a "tool" segment: context, not trained, as in
    the multi-turn loop), the model's answer."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": prompt.rstrip("=")}})
    return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": f"\n<tool_response>\n{answer}\n</tool_response>\n"},
            {"role": "assistant", "content": answer}]


def direct_answer(answer: str) -> list[dict]:
    """The product without the tool: one assistant turn."""
    return [{"role": "assistant", "content": answer}]


def rows(kind: str, rng: random.Random, n: int, tool_share: float) -> list[dict]:
    out = []
    for _ in range(n):
        prompt, answer = problem(rng)
        if kind == "sft":
            calls = rng.random() < tool_share
            out.append({"input": prompt, "output": tool_answer(prompt, answer) if calls else direct_answer(answer)})
        else:
            out.append({"prompt": prompt, "answer": answer})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--tool-share", type=float, default=TOOL_SHARE,
                    help=f"share of SFT answers that call the calculator (default {TOOL_SHARE})")
    args = ap.parse_args()
    if not 0.0 <= args.tool_share <= 1.0:
        ap.error(f"--tool-share must be in [0, 1], got {args.tool_share}")
    for i, (name, n) in enumerate(SIZES.items()):
        rng = random.Random(args.seed * 1000 + i)   # one stream per file: files are independent
        path = args.out / f"{name}.jsonl"
        with open(path, "w") as f:
            for row in rows("sft" if name.startswith("sft") else "prompt", rng, n, args.tool_share):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()
