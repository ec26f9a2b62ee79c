"""Batch AI feedback over sampled responses (`slurm-align label`, `slurm-align revise`).

Input: `slurm-align generate`'s rows ({"index", "sample", "prompt", "response", ...}; any JSONL
with prompt and response works), grouped by prompt.

- label: for each prompt, a pair of its distinct responses (the first two), judged pairwise
  against the principles in both orders (client.pairwise_probs); written as preference rows
  {"prompt", "chosen", "rejected", "judge_p"} (judge_p = p(chosen is better)), the DPO/RM
  trainers' format. `random_labels`: the no-feedback control, chosen by a seeded coin and no
  judge asked (judge_p = 0.5). Pairs whose verdict is within `min_margin` of 0.5 are left out.
- revise: self-critique and revision against the principles, for models too small to write a
  critique: each response is critiqued by the judge (its pairwise wins against the prompt's other
  responses), and the revision is the response the critique ranks first; written as SFT rows
  {"input", "output", "judge_wins"}. A prompt whose responses all tie keeps none, nor (with
  `min_margin`) one whose revision wins its comparisons with a mean probability below
  0.5 + min_margin: a small judge's confident picks are right more often (docs/cai.md). Its
  control (`random_choice`) takes a random response of each prompt, no judge asked.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

import numpy as np

from slurm_align.judge.client import Judge, pairwise_probs
from slurm_align.judge.prompts import JudgeTemplate
from slurm_align.rundir import write_atomic


def read_samples(path: Path) -> dict[str, list[str]]:
    """prompt -> its responses, in file order (a folder: generate's shard_*.jsonl)."""
    files = sorted(path.glob("shard_*.jsonl")) if path.is_dir() else [path]
    by_prompt: dict[str, list[str]] = defaultdict(list)
    for f in files:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for k in ("prompt", "response"):
                if not isinstance(row.get(k), str):
                    raise ValueError(f"{f}:{i}: field {k!r} is {row.get(k)!r}; expected text "
                                     "(rows of `slurm-align generate`: prompt, response)")
            by_prompt[row["prompt"]].append(row["response"])
    return by_prompt


def _write(out: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))


def label(samples: dict[str, list[str]], judge: Judge | None, template: JudgeTemplate, principles: Sequence[str],
          *, random_labels: bool = False, seed: int = 0, min_margin: float = 0.0) -> list[dict]:
    pairs = []
    for prompt, responses in samples.items():
        distinct = list(dict.fromkeys(responses))
        if len(distinct) >= 2:
            pairs.append((prompt, distinct[0], distinct[1]))
    if random_labels:
        rng = random.Random(seed)
        p = np.array([float(rng.random() < 0.5) for _ in pairs])
    else:
        assert judge is not None
        p = pairwise_probs(judge, template, principles, pairs) if pairs else np.zeros(0)
    rows = []
    for (prompt, a, b), pa in zip(pairs, p):
        if not random_labels and abs(pa - 0.5) < min_margin:
            continue
        chosen, rejected = (a, b) if pa >= 0.5 else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                     "judge_p": 0.5 if random_labels else float(max(pa, 1 - pa))})
    return rows


def revise(samples: dict[str, list[str]], judge: Judge | None, template: JudgeTemplate,
           principles: Sequence[str], *, random_choice: bool = False, seed: int = 0,
           min_margin: float = 0.0) -> list[dict]:
    """`random_choice`: the no-feedback control, a seeded random response of each prompt."""
    if random_choice:
        rng = random.Random(seed)
        return [{"input": prompt, "output": rng.choice(list(dict.fromkeys(responses))), "judge_wins": 0.0}
                for prompt, responses in samples.items()]
    assert judge is not None
    items, owners = [], []
    for prompt, responses in samples.items():
        distinct = list(dict.fromkeys(responses))
        for i, j in combinations(range(len(distinct)), 2):
            items.append((prompt, distinct[i], distinct[j]))
            owners.append((prompt, i, j))
    p = pairwise_probs(judge, template, principles, items) if items else np.zeros(0)
    wins: dict[str, np.ndarray] = {pr: np.zeros(len(dict.fromkeys(r))) for pr, r in samples.items()}
    for (prompt, i, j), pa in zip(owners, p):
        wins[prompt][i] += pa
        wins[prompt][j] += 1 - pa
    rows = []
    for prompt, responses in samples.items():
        distinct = list(dict.fromkeys(responses))
        w = wins[prompt]
        if len(distinct) == 1 or np.ptp(w) == 0:
            continue
        best = int(np.argmax(w))
        if w[best] / (len(distinct) - 1) < 0.5 + min_margin:
            continue
        rows.append({"input": prompt, "output": distinct[best], "judge_wins": float(w[best])})
    return rows
