"""The synthetic sort task's verifiable reward (examples/synthetic): the prompt is digits and '=',
the right answer those digits sorted.

`exact`: 1 for exactly the sorted digits, else 0. `partial`: 1 for exact; otherwise up to 0.5 for
a response that keeps the prompt's digits (multiset overlap) in order, so that only the exact
answer reaches the top: printing '1111' or a sorted subset never beats sorting.
"""

from __future__ import annotations

import itertools
from collections import Counter


def target(prompt: str) -> str:
    """The right answer for a prompt such as '7391=': '1379'."""
    return "".join(sorted(c for c in prompt.rstrip().removesuffix("=") if c.isdigit()))


def exact(response: str, prompt: str, **_fields) -> float:
    return float(response.strip() == target(prompt))


def partial(response: str, prompt: str, **_fields) -> float:
    want, got = target(prompt), response.strip()
    if got == want:
        return 1.0
    digits = [c for c in got if c.isdigit()]
    if not digits or not want:
        return 0.0
    common = sum((Counter(digits) & Counter(want)).values())
    overlap = common / max(len(want), len(got))          # extra characters count against it
    in_order = sum(a <= b for a, b in itertools.pairwise(digits)) / max(len(digits) - 1, 1)
    return 0.5 * overlap * in_order
