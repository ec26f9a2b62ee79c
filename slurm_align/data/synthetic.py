"""The synthetic task: "sort the digits".

A prompt is a few random digits followed by '=' (e.g. "7391="); a good response is the same
digits in non-decreasing order ("1379"). Preference pairs prefer the sorted response over a
shuffled one. `score(response)` measures the property independently of any reward model:
the fraction of adjacent digit pairs in order, times the fraction of characters that are digits
(0 for responses with fewer than 2 digits). Random shuffles score about 0.5, sorted ones 1.0.
"""

from __future__ import annotations

import itertools
import random

MIN_DIGITS, MAX_DIGITS = 4, 7


def make_prompt(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
    return "".join(digits) + "=", "".join(sorted(digits))


def shuffled(rng: random.Random, good: str) -> str:
    """A permutation of `good` that is not sorted (when one exists)."""
    chars = list(good)
    for _ in range(20):
        rng.shuffle(chars)
        if "".join(chars) != good:
            break
    return "".join(chars)


def score(response: str) -> float:
    text = response.strip()
    digits = [c for c in text if c.isdigit()]
    if len(digits) < 2:
        return 0.0
    in_order = sum(a <= b for a, b in itertools.pairwise(digits)) / (len(digits) - 1)
    return in_order * len(digits) / len(text)


def sft_rows(rng: random.Random, n: int) -> list[dict]:
    return [{"input": p, "output": good} for p, good in (make_prompt(rng) for _ in range(n))]


def corrupted(rng: random.Random, good: str) -> str:
    """A bad response for the preference data. Not only shuffles: a reward model that has seen
    only shuffles rates a short or empty answer highly, and PPO finds that hole at once."""
    kind = rng.random()
    if kind < 0.5:
        return shuffled(rng, good)
    if kind < 0.7:                       # a digit dropped (sorted, but not the prompt's digits)
        i = rng.randrange(len(good))
        return good[:i] + good[i + 1:]
    if kind < 0.85:                      # truncated to a prefix, possibly empty
        return good[: rng.randrange(len(good) - 1)]
    i = rng.randrange(len(good) + 1)     # a digit added
    return good[:i] + str(rng.randrange(10)) + good[i:]


def preference_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        p, good = make_prompt(rng)
        rows.append({"prompt": p, "chosen": good, "rejected": corrupted(rng, good)})
    return rows


def prompt_rows(rng: random.Random, n: int) -> list[dict]:
    return [{"prompt": make_prompt(rng)[0]} for _ in range(n)]


def heldout_prompt_rows(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    """`n` distinct prompts, none of them in `seen` (the prompts of every training file): a
    held-out set measures the task, not recall. The task has about 11 million prompts, so
    thousands are drawn from the same stream as prompt_rows, skipping repeats."""
    rows: list[dict] = []
    taken = set(seen)
    while len(rows) < n:
        prompt = make_prompt(rng)[0]
        if prompt not in taken:
            taken.add(prompt)
            rows.append({"prompt": prompt})
    return rows
