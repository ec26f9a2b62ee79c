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

HELD_OUT = 200
"""Held-out problems, distinct: prompts_val.jsonl, and sft_val.jsonl in SFT form."""
SIZES = {"sft_train": 4000, "sft_val": HELD_OUT, "prompts": 1000, "prompts_val": HELD_OUT}
TOOL_SHARE = 0.3
"""Share of SFT answers that call the calculator; the others answer at once (and are wrong when
the model writes them: it cannot multiply in its head)."""


def problem(rng: random.Random) -> Problem:
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


def row(kind: str, prompt: str, answer: str, rng: random.Random, tool_share: float) -> dict:
    """A prompt row, or an SFT row whose answer calls the tool with probability tool_share."""
    if kind == "sft":
        calls = rng.random() < tool_share
        return {"input": prompt, "output": tool_answer(prompt, answer) if calls else direct_answer(answer)}
    return {"prompt": prompt, "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--tool-share", type=float, default=TOOL_SHARE,
                    help=f"share of SFT answers that call the calculator (default {TOOL_SHARE})")
    args = ap.parse_args()
    if not 0.0 <= args.tool_share <= 1.0:
        ap.error(f"--tool-share must be in [0, 1], got {args.tool_share}")
    streams = {name: random.Random(args.seed * 1000 + i) for i, name in enumerate(SIZES)}   # one per file
    held = distinct(lambda: problem(streams["prompts_val"]), HELD_OUT)
    held_prompts = {p for p, _ in held}
    for name, n in SIZES.items():
        rng, kind = streams[name], "sft" if name.startswith("sft") else "prompt"

        def draw(rng: random.Random = rng) -> Problem:
            return problem(rng)

        path = args.out / f"{name}.jsonl"
        with open(path, "w") as f:
            for i in range(n):
                # a training row draws its problem, then (SFT) whether it calls the tool
                prompt, answer = held[i] if name.endswith("_val") else outside(draw, held_prompts)
                f.write(json.dumps(row(kind, prompt, answer, rng, args.tool_share)) + "\n")
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()
