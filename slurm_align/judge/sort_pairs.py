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


def near_miss(rng: random.Random, good: str) -> str:
    """A wrong answer one edit from the right one `good`, the CAI policy's commonest errors: one digit
    replaced by another (re-sorted or not), one digit repeated or dropped (sorted), or two
    neighbouring digits swapped."""
    while True:
        kind, i = rng.random(), rng.randrange(len(good))
        if kind < 0.5:                   # one wrong digit
            s = good[:i] + str(rng.randrange(10)) + good[i + 1:]
            bad = "".join(sorted(s)) if rng.random() < 0.7 else s
        elif kind < 0.7:                 # a digit repeated
            bad = good[:i] + good[i] + good[i:]
        elif kind < 0.85:                # a digit dropped
            bad = good[:i] + good[i + 1:]
        else:                            # neighbours swapped
            j = min(i, len(good) - 2)
            bad = good[:j] + good[j + 1] + good[j] + good[j + 2:]
        if bad != good:
            return bad


def fresh_prompt(rng: random.Random, seen: frozenset[str] | set[str]) -> tuple[str, str]:
    """(prompt, right answer) of a prompt not in `seen` (the task's training, red-team and
    held-out prompts: a quarter of the task's prompts have 4 digits, only 10,000 of them)."""
    while True:
        prompt, good = synthetic.make_prompt(rng)
        if prompt not in seen:
            return prompt, good


def near_miss_rows(rng: random.Random, n: int, template: str = "pairwise_compact",
                   seen: frozenset[str] = frozenset()) -> list[dict]:
    """SFT rows of the right answer against a near miss (`near_miss`), in a random order, on fresh
    prompts: the pairs a revision turns on, which the policy's own samples hold too few of for the
    judge to learn them (docs/cai.md); none on the prompts in `seen`."""
    tpl = JudgeTemplate.get(template)
    rows = []
    for _ in range(n):
        prompt, good = fresh_prompt(rng, seen)
        bad = near_miss(rng, good)
        a, b = (good, bad) if rng.random() < 0.5 else (bad, good)
        rows.append({"input": pairwise_prompt(tpl, SORT_PRINCIPLE, prompt, a, b), "output": rule_verdict(prompt, a, b)})
    return rows


def sort_demo_rows(rng: random.Random, n: int, seen: frozenset[str] = frozenset()) -> list[dict]:
    """The judge's auxiliary task: writing the right answer itself, after the prompt ("41672=" ->
    "12467") and, half of the time, after a first answer as the pairwise prompt shows it
    ("41672=12466|" -> "12467": the second answer's place). A verdict is one token of supervision
    per pair and the judge learnt the near misses slowly from verdicts alone (their agreement at
    chance after 8,000 steps); predicting each digit of the right answer at the places the answers
    stand makes a wrong digit visible to it (docs/cai.md). None on the prompts in `seen`."""
    rows = []
    for i in range(n):
        prompt, good = fresh_prompt(rng, seen)
        if i % 2:
            first = good if rng.random() < 0.5 else near_miss(rng, good)
            rows.append({"input": prompt + first + "|", "output": good})
        else:
            rows.append({"input": prompt, "output": good})
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


def seen_prompts(files) -> frozenset[str]:
    """The prompts of JSONL files with prompt or input fields (the task's training, red-team and
    held-out prompts)."""
    seen: set[str] = set()
    for f in files:
        for line in Path(f).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                seen.update(str(row[k]) for k in ("prompt", "input") if k in row)
    return frozenset(seen)


def judge_prompt_rows(n: int, seen_files, seed: int = 40) -> list[dict]:
    """`n` prompts for the judge's own training samples, none of them in `seen_files`."""
    return synthetic.heldout_prompt_rows(random.Random(seed), n, set(seen_prompts(seen_files)))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_judge_data(folder, train: int = 8000, val: int = 200, seed: int = 11, samples=None,
                     near_misses: int = 0, demos: int = 0, seen: frozenset[str] = frozenset()) -> None:
    """folder/judge_train.jsonl and judge_val.jsonl (examples/judge_tiny.yaml trains on them):
    `train` rule pairs, `near_misses` near-miss pairs and `demos` rows of the auxiliary task (none
    on the prompts in `seen`), and with `samples` (a `slurm-align generate` folder) every policy
    pair of them as well, shuffled; `val` rule pairs (and as many policy pairs, and near-miss pairs
    when there are any) held out."""
    from slurm_align.judge.label import read_samples

    folder = Path(folder)
    train_rows = judge_sft_rows(random.Random(seed), train)
    val_rows = judge_sft_rows(random.Random(seed + 1), val)
    if near_misses:
        train_rows += near_miss_rows(random.Random(seed + 3), near_misses, seen=seen)
        val_rows += near_miss_rows(random.Random(seed + 4), val, seen=seen)
    train_rows += sort_demo_rows(random.Random(seed + 6), demos, seen=seen)
    if near_misses or demos:
        random.Random(seed + 5).shuffle(train_rows)
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
    ap.add_argument("--near-misses", type=int, default=0,
                    help="training pairs of the right answer against a near miss (one digit off)")
    ap.add_argument("--demos", type=int, default=0,
                    help="training rows of the judge's auxiliary task: the right answer written out")
    ap.add_argument("--prompts", type=int, default=0,
                    help="write N judge prompts (folder/judge_prompts.jsonl) instead, none in --exclude")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[],
                    help="JSONL files whose prompts to avoid (the judge's prompts, near misses and demos)")
    args = ap.parse_args(argv)
    if args.prompts:
        write_jsonl(args.folder / "judge_prompts.jsonl", judge_prompt_rows(args.prompts, args.exclude))
    else:
        write_judge_data(args.folder, train=args.rule_pairs, samples=args.samples,
                         near_misses=args.near_misses, demos=args.demos, seen=seen_prompts(args.exclude))


if __name__ == "__main__":   # python -m slurm_align.judge.sort_pairs FOLDER [--samples GEN | --prompts N]
    main()
