"""Model-written code run against a data row's tests, in the sandbox the python tool uses
(environments/sandbox.py: an unprivileged user, no network, CPU/memory/file/process limits, a
wall-clock timeout, a PID namespace and private /tmp so that nothing it starts or writes outlives
the run).

    reward.rule: slurm_align.rewards.code:passes_tests
    rows: {"prompt": "Write f(x) returning x squared.", "tests": "assert f(3) == 9\\nassert f(-2) == 4"}

The program run is the response's code (its last ```python fenced block, else the whole
response) followed by the row's `tests` (Python source, or a list of statements); the reward is
1.0 when it exits 0 within the limits, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

from slurm_align.environments.sandbox import SandboxLimits, SandboxResult, run_code

LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=10, memory_bytes=1 << 30, processes=16)
"""Limits of one scoring run (the tool sandbox's defaults)."""
FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str:
    """The last fenced code block of the response, else the response as it is."""
    blocks = FENCE.findall(response)
    return blocks[-1] if blocks else response


def test_program(code: str, tests: str | list[str]) -> str:
    """The program that checks `code`: the code, then the tests."""
    body = tests if isinstance(tests, str) else "\n".join(tests)
    return f"{code}\n\n# -- tests --\n{body}\n"


def run_tests(response: str, tests: str | list[str], limits: SandboxLimits = LIMITS) -> SandboxResult:
    """The sandboxed run of the response's code against `tests` (never raises for what the code does)."""
    return run_code(test_program(extract_code(response), tests), limits)


def passes_tests(response: str, prompt: str, tests: Any = None, **_: Any) -> float:
    """1.0 when the response's code passes the row's `tests` in the sandbox, else 0.0."""
    if not isinstance(tests, str | list) or not tests:
        raise ValueError(f"the data row's 'tests' must be Python source or a list of statements, got {tests!r} "
                         "(data.columns can map a column onto 'tests')")
    r = run_tests(response, tests)
    return float(r.exit_code == 0 and not r.timed_out)
