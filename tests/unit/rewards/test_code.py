"""The code reward: correct code passes its tests, wrong code fails them, hostile code is
contained by the sandbox (nothing it starts or writes outlives the scoring run)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from slurm_align.environments.sandbox import SandboxLimits
from slurm_align.rewards.code import extract_code, passes_tests, run_tests
from slurm_align.rewards.rule import RuleReward
from tests.unit.environments.test_sandbox import survivors

TESTS = "assert square(3) == 9\nassert square(-2) == 4\n"
SHORT = SandboxLimits(timeout_s=5.0, cpu_s=3, processes=8)


def test_correct_code_passes_and_wrong_code_fails():
    right = "Here it is:\n```python\ndef square(x):\n    return x * x\n```\nDone."
    wrong = "```python\ndef square(x):\n    return 2 * x\n```"
    assert passes_tests(right, "p", tests=TESTS) == 1.0
    assert passes_tests(wrong, "p", tests=TESTS) == 0.0
    assert passes_tests("def square(x): return x**2", "p", tests=["assert square(5) == 25"]) == 1.0
    assert passes_tests("no code at all", "p", tests=TESTS) == 0.0
    rule = RuleReward.load("slurm_align.rewards.code:passes_tests")
    assert rule.many([right, wrong], [{"prompt": "p", "tests": TESTS}] * 2) == [1.0, 0.0]
    with pytest.raises(Exception, match="'tests'"):
        rule(right, "p", {})


def test_the_last_fenced_block_is_the_code():
    assert extract_code("```python\na = 1\n```\nthen\n```py\nb = 2\n```") == "b = 2\n"


def test_hostile_code_is_contained():
    marker = f"{os.getpid()}{time.time_ns() % 10**6 + 7}"
    left = f"code-reward-left-{marker}"
    hostile = ("```python\nimport os, subprocess\n"
               f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
               f"open('/tmp/{left}', 'w').write('x')\nopen('/dev/shm/{left}', 'w').write('x')\n"
               "def square(x):\n    while True:\n        pass\n```")
    r = run_tests(hostile, TESTS, SHORT)
    # stopped by the wall-clock limit, or (an idle machine: the loop gets its 3 CPU-s before 5 s
    # pass) by the CPU limit's SIGXCPU/SIGKILL; which comes first depends on the load beside it
    assert r.timed_out or r.exit_code in (-signal.SIGKILL, -signal.SIGXCPU), r
    assert r.exit_code != 0
    assert survivors(marker) == []
    assert not Path("/tmp", left).exists() and not Path("/dev/shm", left).exists()
    r = run_tests("```python\nimport socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n```", "", SHORT)
    assert r.network_isolated and r.exit_code == 1 and "OSError" in r.stderr, r
