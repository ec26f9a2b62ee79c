"""Judging prompts: Jinja2 templates rendered with StrictUndefined (a missing field is an error,
never an empty string in a judge's prompt).

A template is named in JUDGE_TEMPLATES or given inline. Pairwise templates get `principle`,
`prompt`, `a`, `b` and answer with one of PAIRWISE_ANSWERS; pointwise ones get `principle`,
`prompt`, `response` and answer with a digit of POINTWISE_ANSWERS (the score). The `*_compact`
templates are for the small byte-level judges trained here (every character is a token of a
64-token context); the others are for instruction-following LLMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2

PAIRWISE_ANSWERS = ("A", "B")
POINTWISE_ANSWERS = tuple(str(d) for d in range(10))

JUDGE_TEMPLATES: dict[str, str] = {
    "pairwise": (
        "You are judging two answers to the same prompt.\n"
        "Principle: {{ principle }}\n"
        "Prompt: {{ prompt }}\n"
        "Answer A: {{ a }}\n"
        "Answer B: {{ b }}\n"
        "Which answer better satisfies the principle? Reply with A or B only.\n"
        "Verdict: "),
    "pointwise": (
        "You are scoring an answer to a prompt.\n"
        "Principle: {{ principle }}\n"
        "Prompt: {{ prompt }}\n"
        "Answer: {{ response }}\n"
        "How well does the answer satisfy the principle, from 0 (not at all) to 9 (fully)? "
        "Reply with one digit.\n"
        "Score: "),
    # The principle is the one this judge was trained on: it is not spelled out in its context.
    # Answers are cut to 9 characters (the task's answers have at most 7 digits) to fit 32 tokens.
    "pairwise_compact": "{{ prompt }}{{ a[:9] }}|{{ b[:9] }}?",
    "pointwise_compact": "{{ prompt }}{{ response[:9] }}?",
    "critique": (
        "Principle: {{ principle }}\nPrompt: {{ prompt }}\nAnswer: {{ response }}\n"
        "Critique the answer against the principle.\nCritique: "),
    "revision": (
        "Principle: {{ principle }}\nPrompt: {{ prompt }}\nAnswer: {{ response }}\n"
        "Critique: {{ critique }}\nRewrite the answer so that it satisfies the principle.\n"
        "Revision: "),
}

KINDS = ("pairwise", "pointwise")


class JudgePromptError(ValueError):
    """A judging template that does not parse or lacks a field; the message names both."""


_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)


@dataclass(frozen=True)
class JudgeTemplate:
    name: str
    """The template's name in JUDGE_TEMPLATES, or 'inline'."""
    source: str
    """Its Jinja2 text."""

    @classmethod
    def get(cls, name_or_text: str) -> JudgeTemplate:
        """A named template, or the text itself when it holds a Jinja2 expression."""
        if name_or_text in JUDGE_TEMPLATES:
            return cls(name_or_text, JUDGE_TEMPLATES[name_or_text])
        if "{{" in name_or_text:
            return cls("inline", name_or_text)
        raise JudgePromptError(f"judge template {name_or_text!r}: not one of {sorted(JUDGE_TEMPLATES)} "
                               "and not a Jinja2 template (no '{{ ... }}')")

    def render(self, **fields: str) -> str:
        try:
            return _ENV.from_string(self.source).render(**fields)
        except jinja2.TemplateSyntaxError as e:
            raise JudgePromptError(f"judge template {self.name!r}: line {e.lineno}: {e.message}") from e
        except jinja2.UndefinedError as e:
            raise JudgePromptError(f"judge template {self.name!r}: {e.message} (fields given: "
                                   f"{sorted(fields)})") from e


def pairwise_prompt(template: JudgeTemplate, principle: str, prompt: str, a: str, b: str) -> str:
    return template.render(principle=principle, prompt=prompt, a=a, b=b)


def pointwise_prompt(template: JudgeTemplate, principle: str, prompt: str, response: str) -> str:
    return template.render(principle=principle, prompt=prompt, response=response)
