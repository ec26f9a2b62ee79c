"""Judge training and test data on the synthetic sort task: pairs of answers to one prompt, the
verdict ("A" or "B") the task's rule gives (the higher `rewards.sort.partial`; exact answers score
1), rendered with a pairwise template. The pairs are of the sort the CAI pipeline's policy makes:
the right answer against a corrupted one (shuffled, a digit dropped or added, truncated), and two
different corrupted ones; pairs the rule ties are not drawn.

Those corruptions miss the commonest error of the CAI example's policy (a sorted answer with one
wrong digit): a judge trained on them alone judged the policy's own pairs near chance
(docs/cai.md). So the CAI example's judge also trains on the policy's own samples
(`policy_pair_rows`: the right answer against each wrong sample), on prompts of their own
(`judge_prompt_rows`: none of the task's training, red-team or held-out prompts), labelled by
the rule: the rule labels the judge's training set only; the pipeline's feedback is the trained
judge's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from slurm_align.data import synthetic
from slurm_align.judge.prompts import JudgeTemplate, pairwise_prompt
from slurm_align.rewards.sort import partial, target

SORT_PRINCIPLE = "the answer lists the prompt's digits, all of them, in ascending order"


def rule_pair(rng: random.Random) -> tuple[str, str, str]:
    """(prompt, a, b) with partial(a) != partial(b)."""
    while True:
        prompt, good = synthetic.make_prompt(rng)
        x = good if rng.random() < 0.6 else synthetic.corrupted(rng, good)
        y = synthetic.corrupted(rng, good)
        if partial(x, prompt) == partial(y, prompt):
            continue
        return (prompt, x, y) if rng.random() < 0.5 else (prompt, y, x)


def rule_verdict(prompt: str, a: str, b: str) -> str:
    """'A' when the rule prefers a, else 'B'."""
    return "A" if partial(a, prompt) > partial(b, prompt) else "B"


def judge_sft_rows(rng: random.Random, n: int, template: str = "pairwise_compact") -> list[dict]:
    """SFT rows {"input": judging prompt, "output": verdict} for a judge of the sort task."""
    tpl = JudgeTemplate.get(template)
    rows = []
    for _ in range(n):
        prompt, a, b = rule_pair(rng)
        rows.append({"input": pairwise_prompt(tpl, SORT_PRINCIPLE, prompt, a, b),
                     "output": rule_verdict(prompt, a, b)})
    return rows


def fits(row: dict, max_seq_len: int = 32) -> bool:
    """The row's judging prompt, verdict, BOS and EOS fit the judge's byte-level context (a sampled
    response may hold bytes that decode to multi-byte characters)."""
    return len(row["input"].encode()) + len(row["output"].encode()) + 2 <= max_seq_len


def policy_pair_rows(samples: dict[str, list[str]], rng: random.Random,
                     template: str = "pairwise_compact") -> list[dict]:
    """SFT rows of the rule's verdicts on a policy's own samples (label.read_samples' prompt ->
    responses): the right answer against each distinct wrong response, in a random order; rows that
    do not fit the judge's context are left out. Only right-against-wrong pairs: revisions need the
    right answer picked among near misses, and a judge trained on every pair of samples (wrong
    against wrong too, judged by the rule's partial credit) picked it less often (docs/cai.md)."""
    tpl = JudgeTemplate.get(template)
    rows = []
    for prompt, responses in samples.items():
        right = target(prompt)
        for wrong in dict.fromkeys(responses):
            if wrong == right:
                continue
            a, b = (right, wrong) if rng.random() < 0.5 else (wrong, right)
            row = {"input": pairwise_prompt(tpl, SORT_PRINCIPLE, prompt, a, b), "output": rule_verdict(prompt, a, b)}
            if fits(row):
                rows.append(row)
    return rows


def judge_prompt_rows(n: int, seen_files, seed: int = 40) -> list[dict]:
    """`n` prompts for the judge's own training samples, none of them in `seen_files` (JSONL with
    prompt or input fields: the task's training, red-team and held-out prompts)."""
    seen: set[str] = set()
    for f in seen_files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                seen.update(str(row[k]) for k in ("prompt", "input") if k in row)
    return synthetic.heldout_prompt_rows(random.Random(seed), n, seen)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_judge_data(folder, train: int = 8000, val: int = 200, seed: int = 11, samples=None) -> None:
    """folder/judge_train.jsonl and judge_val.jsonl (examples/judge_tiny.yaml trains on them):
    `train` rule pairs, and with `samples` (a `slurm-align generate` folder) every policy pair of
    them as well, shuffled; `val` rule pairs (and as many policy pairs) held out."""
    from slurm_align.judge.label import read_samples

    folder = Path(folder)
    train_rows = judge_sft_rows(random.Random(seed), train)
    val_rows = judge_sft_rows(random.Random(seed + 1), val)
    if samples is not None:
        rng = random.Random(seed + 2)
        policy = policy_pair_rows(read_samples(Path(samples)), rng)
        rng.shuffle(policy)
        val_rows += policy[:val]
        train_rows += policy[val:]
        rng.shuffle(train_rows)
    write_jsonl(folder / "judge_train.jsonl", train_rows)
    write_jsonl(folder / "judge_val.jsonl", val_rows)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m slurm_align.judge.sort_pairs",
                                 description="the sort task judge's training data (docs/judge.md, docs/cai.md)")
    ap.add_argument("folder", type=Path, help="writes judge_train.jsonl and judge_val.jsonl (or judge_prompts.jsonl)")
    ap.add_argument("--samples", type=Path, default=None,
                    help="a `slurm-align generate` folder of the policy's samples on the judge's prompts: "
                         "their pairs join the rule pairs")
    ap.add_argument("--rule-pairs", type=int, default=8000, help="training pairs of the rule's corruptions")
    ap.add_argument("--prompts", type=int, default=0,
                    help="write N judge prompts (folder/judge_prompts.jsonl) instead, none in --exclude")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[], help="JSONL files whose prompts to avoid")
    args = ap.parse_args(argv)
    if args.prompts:
        write_jsonl(args.folder / "judge_prompts.jsonl", judge_prompt_rows(args.prompts, args.exclude))
    else:
        write_judge_data(args.folder, train=args.rule_pairs, samples=args.samples)


if __name__ == "__main__":   # python -m slurm_align.judge.sort_pairs FOLDER [--samples GEN | --prompts N]
    main()
