"""Verifiable reward for the small-arithmetic task (examples/arithmetic): the answer rides in the
data row (`{"prompt": "3+4*2=", "answer": "11"}`); the response must be exactly that answer."""

from __future__ import annotations


def exact_answer(response: str, prompt: str, answer: str, **_fields) -> float:
    return float(response.strip() == str(answer).strip())
