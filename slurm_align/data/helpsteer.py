"""HelpSteer2-format rows on the synthetic sort task (examples/synthetic/README.md): SFT rows
{"input", "output"} with attributes computed from the task itself, for the regression reward
model and SteerLM (examples/steerlm_tiny.sh, the tests): correctness 4 for exactly the sorted
digits and 0 otherwise (the task's rule, slurm_align.rewards.sort:exact), verbosity from the
length (one step of the 0-4 scale per 2 characters, capped at 4).

Rows of the task's pairs alone leave out what a policy writes itself: PPO on a regression RM
trained only on them games it (short, near-miss answers it scores high; tests/integration/
test_regression_ppo.py). `policy_sample_rows` adds the SFT policy's own samples, labelled by the
same rule, on prompts of their own (none of the task's training or held-out prompts: the
sampling of slurm_align/judge/sort_pairs.py, `--prompts` then `--samples`)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.rewards import sort

ATTRIBUTES = ["correctness", "verbosity"]


def attributes(prompt: str, response: str) -> dict[str, float]:
    return {"correctness": 4.0 * sort.exact(response, prompt), "verbosity": min(4.0, len(response) / 2)}


def helpsteer_rows_of(src: Path, responses: Callable[[dict], list[str]]) -> list[dict]:
    """One labelled row per (prompt, response) of each preference pair in `src`, the responses
    chosen by `responses(pair)` (e.g. the chosen and the rejected answer)."""
    return [{"input": pair["prompt"], "output": r, **attributes(pair["prompt"], r)}
            for pair in map(json.loads, src.read_text().splitlines()) for r in responses(pair)]


def helpsteer_rows(src: Path, dst: Path, responses: Callable[[dict], list[str]]) -> Path:
    """`helpsteer_rows_of` written to `dst`."""
    out = helpsteer_rows_of(src, responses)
    dst.write_text("".join(json.dumps(o) + "\n" for o in out))
    return dst


def policy_sample_rows(samples: dict[str, list[str]], max_seq_len: int = 32) -> list[dict]:
    """Labelled rows of a policy's own samples (judge.label.read_samples' prompt -> responses):
    per prompt the right answer and each distinct response, rows that do not fit the model's
    byte-level context (prompt, response, BOS, EOS) left out."""
    from slurm_align.judge.sort_pairs import fits  # the judge's rows' rule: input + output + BOS + EOS

    rows = [{"input": prompt, "output": r, **attributes(prompt, r)}
            for prompt, responses in samples.items() for r in dict.fromkeys([sort.target(prompt), *responses])]
    return [row for row in rows if fits(row, max_seq_len)]


def chosen_and_rejected(pair: dict) -> list[str]:
    """The pair's two answers (the rejected one: a corruption of the sorted answer)."""
    return [pair["chosen"], pair["rejected"]]


def sorted_and_copied(pair: dict) -> list[str]:
    """Per prompt the sorted answer (correctness 4) and the prompt's digits as given (0: what a
    model that copies writes)."""
    return [sort.target(pair["prompt"]), pair["prompt"].removesuffix("=")]


def write_policy_rows(out: Path, samples: Path | list[Path], val_prompts: int = 200,
                      seed: int = 0) -> tuple[Path, Path]:
    """OUT/helpsteer_policy_{train,val}.jsonl: the task's preference pairs' chosen and rejected
    answers (examples/synthetic/pref_*.jsonl) and `policy_sample_rows` of `samples` (`slurm-align
    generate` folders, e.g. the SFT policy's and a PPO policy's, on prompts of their own), the
    samples of `val_prompts` of their prompts held out; training rows shuffled."""
    from slurm_align.judge.label import read_samples

    rng = random.Random(seed)
    by_prompt: dict[str, list[str]] = {}
    for folder in [samples] if isinstance(samples, Path) else samples:
        for prompt, responses in read_samples(folder).items():
            by_prompt.setdefault(prompt, []).extend(responses)
    prompts = sorted(by_prompt)
    rng.shuffle(prompts)
    held = set(prompts[:val_prompts])
    rows = {split: helpsteer_rows_of(REPO_ROOT / "examples" / "synthetic" / f"pref_{split}.jsonl", chosen_and_rejected)
            for split in ("train", "val")}
    rows["train"] += policy_sample_rows({p: r for p, r in by_prompt.items() if p not in held})
    rows["val"] += policy_sample_rows({p: r for p, r in by_prompt.items() if p in held})
    rng.shuffle(rows["train"])
    paths = []
    for split in ("train", "val"):
        dst = out / f"helpsteer_policy_{split}.jsonl"
        dst.write_text("".join(json.dumps(o) + "\n" for o in rows[split]))
        paths.append(dst)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> None:
    """`python -m slurm_align.data.helpsteer OUT_DIR`: OUT_DIR/helpsteer_{train,val}.jsonl from the
    task's preference pairs (examples/synthetic/pref_*.jsonl), two rows per prompt (sorted_and_copied).
    With --prompts N: OUT_DIR/policy_prompts.jsonl, N prompts for the policy's samples (none in
    --exclude); with --samples GEN: OUT_DIR/helpsteer_policy_{train,val}.jsonl (write_policy_rows)."""
    import argparse

    from slurm_align.judge.sort_pairs import judge_prompt_rows, write_jsonl

    ap = argparse.ArgumentParser(prog="python -m slurm_align.data.helpsteer",
                                 description="HelpSteer2-format rows of the sort task (docs/algorithms/dpo.md)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--prompts", type=int, default=0,
                    help="write N prompts for the policy's samples (OUT/policy_prompts.jsonl), none in --exclude")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[], help="JSONL files whose prompts to avoid")
    ap.add_argument("--samples", type=Path, nargs="+", default=None,
                    help="`slurm-align generate` folders of the policy's samples on such prompts: their rows "
                         "join the task's chosen and rejected answers (OUT/helpsteer_policy_{train,val}.jsonl)")
    args = ap.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.prompts:
        write_jsonl(out / "policy_prompts.jsonl", judge_prompt_rows(args.prompts, args.exclude))
        dsts = [out / "policy_prompts.jsonl"]
    elif args.samples is not None:
        dsts = list(write_policy_rows(out, args.samples))
    else:
        dsts = [helpsteer_rows(REPO_ROOT / "examples" / "synthetic" / f"pref_{split}.jsonl",
                               out / f"helpsteer_{split}.jsonl", sorted_and_copied) for split in ("train", "val")]
    for dst in dsts:
        print(f"{dst}: {len(dst.read_text().splitlines())} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
