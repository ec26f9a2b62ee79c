"""Write the synthetic "sort the digits" task's JSONL files (see README.md).

    python examples/synthetic/generate.py [--seed 0] [--out examples/synthetic]

prompts_val.jsonl is held out: distinct prompts, none of them in a training file (SFT, preference
or RL prompts, train or val), written last. Its size gives a test of held-out accuracy its power:
at 2,000 prompts a gain of 3 points is told from evaluation noise (tests/test_grpo.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from slurm_align.data.synthetic import heldout_prompt_rows, preference_rows, prompt_rows, sft_rows

SIZES = {"sft_train": 2000, "sft_val": 200, "pref_train": 2000, "pref_val": 200, "prompts": 500,
         "prompts_val": 2000}
HELD_OUT = "prompts_val"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    makers = {"sft": sft_rows, "pref": preference_rows, "prompts": prompt_rows}
    seen: set[str] = set()   # every prompt of the files written so far
    for i, (name, n) in enumerate(SIZES.items()):
        rng = random.Random(args.seed * 1000 + i)  # one stream per file: files are independent
        rows = heldout_prompt_rows(rng, n, seen) if name == HELD_OUT else makers[name.split("_")[0]](rng, n)
        seen.update(r.get("prompt", r.get("input")) for r in rows)
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {path} ({n} lines)")


if __name__ == "__main__":
    main()
