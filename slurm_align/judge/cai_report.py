"""The Constitutional AI example's verdict (examples/cai_tiny.sh): each policy's held-out exact
accuracy and exact one-sided sign tests over the same prompts (analysis/significance.py):
the judge arm's end against the SFT start, the control's end against the start.

    python -m slurm_align.judge.cai_report RUNS_DIR   # prints one line per comparison, JSON last
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from slurm_align.analysis.significance import paired_counts

ARMS = ("sft", "judge_sft", "judge_dpo", "control_sft", "control_dpo")


def correct(runs: Path, name: str) -> tuple[list[str], np.ndarray]:
    files = sorted((runs / f"eval-{name}" / "eval").glob("step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{runs / f'eval-{name}' / 'eval'}: no step_*.jsonl (the eval of {name} did not run)")
    rows = [json.loads(x) for x in files[-1].read_text().splitlines() if x]
    return [r["prompt"] for r in rows], np.array([int(r["correct"]) for r in rows])


def report(runs: Path) -> dict:
    got = {a: correct(runs, a) for a in ARMS}
    prompts = got["sft"][0]
    assert all(p == prompts for p, _ in got.values()), "the policies were evaluated on other prompts"
    start = got["sft"][1]
    out: dict = {"accuracy": {a: float(c.mean()) for a, (_, c) in got.items()}}
    for arm in ARMS[1:]:
        counts = paired_counts(start, got[arm][1])
        out[f"{arm}_vs_sft"] = {"b": counts.b, "c": counts.c, "p_better": counts.p_better}
        print(f"{arm}: {counts.after}/{counts.n} vs sft {counts.before}/{counts.n}; {counts}")
    return out


if __name__ == "__main__":
    print(json.dumps(report(Path(sys.argv[1]))))
