"""HelpSteer2-format rows on the synthetic sort task (examples/synthetic/README.md): SFT rows
{"input", "output"} with attributes computed from the task itself, for the regression reward
model and SteerLM tests: correctness 4 for exactly the sorted digits and 0 otherwise (the task's
rule, slurm_align.rewards.sort:exact), verbosity from the length (one step of the 0-4 scale per
2 characters, capped at 4)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

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
