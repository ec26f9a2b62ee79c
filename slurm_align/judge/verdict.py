"""Verdicts from a judge's answer: the log-probs of the allowed answers at the answer's first
position (robust for small models: it never depends on what a model writes after its first
token), or, when only text came back, the first allowed answer found in it.

Pairwise: p(A) = softmax over the allowed answers' log-probs, so p(A) + p(B) = 1 even when the
model puts mass elsewhere. Pointwise: the expected score sum_d d * p(d) / 9 in [0, 1].
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence


class VerdictError(ValueError):
    """Neither log-probs nor text held an allowed answer; the message quotes the text."""


def answer_probs(logprobs: Mapping[str, float], allowed: Sequence[str]) -> list[float]:
    """Normalised probabilities of `allowed` (a missing answer: probability 0). Raises when
    none of them is present (a top-k list from a remote service that held none)."""
    lps = [logprobs.get(a, -math.inf) for a in allowed]
    top = max(lps)
    if top == -math.inf:
        raise VerdictError(f"no allowed answer {list(allowed)} among the judge's log-probs "
                           f"{sorted(logprobs)[:10]}")
    w = [math.exp(lp - top) for lp in lps]
    s = sum(w)
    return [x / s for x in w]


def pairwise_from_logprobs(logprobs: Mapping[str, float], allowed: Sequence[str] = ("A", "B")) -> float:
    """p(first answer is better), i.e. p('A')."""
    return answer_probs(logprobs, allowed)[0]


def pointwise_from_logprobs(logprobs: Mapping[str, float], allowed: Sequence[str]) -> float:
    """Expected score over the digit answers, scaled to [0, 1]."""
    probs = answer_probs(logprobs, allowed)
    top = len(allowed) - 1
    return sum(i * p for i, p in enumerate(probs)) / top if top else probs[0]


def parse_text(text: str, allowed: Sequence[str]) -> str:
    """The first allowed answer standing alone (a word/digit of its own) in `text`."""
    words = re.findall(r"[A-Za-z]+|\d", text)
    for w in words:
        if w in allowed:
            return w
    raise VerdictError(f"judge answered {text[:200]!r}: none of the allowed answers {list(allowed)}")


def pairwise_from_text(text: str, allowed: Sequence[str] = ("A", "B")) -> float:
    return 1.0 if parse_text(text, allowed) == allowed[0] else 0.0


def pointwise_from_text(text: str, allowed: Sequence[str]) -> float:
    top = len(allowed) - 1
    return allowed.index(parse_text(text, allowed)) / top if top else 1.0
