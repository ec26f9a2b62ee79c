"""Math answers checked by equivalence with math-verify (Hugging Face's verifier, as NeMo-RL and
veRL use): the response's final answer (a \\boxed{...} one first, else the last number or
expression) against the row's reference `answer`, compared as values (1/2 = 0.5 = \\frac{2}{4}).

    reward.rule: slurm_align.rewards.math:verified_answer     # rows: {"prompt": ..., "answer": "3/4"}

1.0 when equivalent, 0.0 otherwise (an answer that cannot be parsed included).
"""

from __future__ import annotations

import threading
from typing import Any

from math_verify import parse, verify


def _timeouts() -> int | None:
    # math-verify bounds parsing and comparison with SIGALRM, which only the main thread may set;
    # off it (a tool worker thread), nothing bounds them
    return 5 if threading.current_thread() is threading.main_thread() else None


def as_gold(answer: str) -> list:
    """The reference parsed; a bare value ("3/4", "\\frac{1}{2}") is read as LaTeX math."""
    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return parse(text, parsing_timeout=_timeouts())  # None: no timeout (see _timeouts)


def verified_answer(response: str, prompt: str, answer: Any = None, **_: Any) -> float:
    """1.0 when the response's final answer equals the row's `answer` (math-verify), else 0.0."""
    if answer is None:
        raise ValueError("the data row has no 'answer' field (the reference answer; data.columns can map one)")
    gold = as_gold(str(answer))
    if not gold:
        raise ValueError(f"the reference answer {answer!r} does not parse as math")
    timeout = _timeouts()
    pred = parse(response, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold, pred, timeout_seconds=timeout))
