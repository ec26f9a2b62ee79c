"""HelpSteer2-format rows on the synthetic sort task (examples/synthetic/README.md): SFT rows
{"input", "output"} with attributes computed from the task itself, for the regression reward
model and SteerLM (examples/steerlm_tiny.sh, the tests): correctness 4 for exactly the sorted
digits and 0 otherwise (the task's rule, slurm_align.rewards.sort:exact), verbosity from the
length (one step of the 0-4 scale per 2 characters, capped at 4)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.rewards import sort

ATTRIBUTES = ["correctness", "verbosity"]


def attributes(prompt: str, response: str) -> dict[str, float]:
    return {"correctness": 4.0 * sort.exact(response, prompt), "verbosity": min(4.0, len(response) / 2)}


def helpsteer_rows(src: Path, dst: Path, responses: Callable[[dict], list[str]]) -> Path:
    """One labelled row per (prompt, response) of each preference pair in `src`, the responses
    chosen by `responses(pair)` (e.g. the chosen and the rejected answer)."""
    out = [{"input": pair["prompt"], "output": r, **attributes(pair["prompt"], r)}
           for pair in map(json.loads, src.read_text().splitlines()) for r in responses(pair)]
    dst.write_text("".join(json.dumps(o) + "\n" for o in out))
    return dst


def sorted_and_copied(pair: dict) -> list[str]:
    """Per prompt the sorted answer (correctness 4) and the prompt's digits as given (0: what a
    model that copies writes)."""
    return [sort.target(pair["prompt"]), pair["prompt"].removesuffix("=")]


def main(argv: list[str]) -> None:
    """`python -m slurm_align.data.helpsteer OUT_DIR`: OUT_DIR/helpsteer_{train,val}.jsonl from the
    task's preference pairs (examples/synthetic/pref_*.jsonl), two rows per prompt (sorted_and_copied)."""
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        dst = helpsteer_rows(REPO_ROOT / "examples" / "synthetic" / f"pref_{split}.jsonl",
                             out / f"helpsteer_{split}.jsonl", sorted_and_copied)
        print(f"{dst}: {len(dst.read_text().splitlines())} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
