"""Held-out prompts that are held out: distinct, and never drawn for training.

A task generator (examples/arithmetic, examples/tool_arithmetic) draws its held-out problems
first, with distinct prompts, then each training problem from the same distribution, drawn again
while its prompt is held out. Small tasks need both: the one-digit arithmetic task has 155
distinct prompts, so 200 independently drawn "held-out" rows repeat them (101 distinct) and every
one of them is also in the training files; evaluated so, a learning test measures memory.

    held = distinct(lambda: problem(rng), 200)
    train = [outside(lambda: problem(rng), {p for p, _ in held}) for _ in range(1000)]
"""

from __future__ import annotations

from collections.abc import Callable, Container

Problem = tuple[str, str]
"""A prompt and its answer."""

MAX_DRAWS = 100_000
"""Draws after which a generator gives up: the task has too few distinct prompts for what is asked."""


def distinct(draw: Callable[[], Problem], n: int) -> list[Problem]:
    """`n` problems of `draw` whose prompts differ, in the order first drawn."""
    out: dict[str, str] = {}
    for _ in range(MAX_DRAWS):
        if len(out) == n:
            break
        prompt, answer = draw()
        out.setdefault(prompt, answer)
    if len(out) < n:
        raise ValueError(f"{MAX_DRAWS} draws gave {len(out)} distinct prompts, not {n}: the task has too few")
    return list(out.items())


def outside(draw: Callable[[], Problem], held_out: Container[str]) -> Problem:
    """One problem of `draw` whose prompt is not held out (drawn again while it is)."""
    for _ in range(MAX_DRAWS):
        prompt, answer = draw()
        if prompt not in held_out:
            return prompt, answer
    raise ValueError(f"{MAX_DRAWS} draws gave only held-out prompts: the held-out set leaves nothing to train on")
