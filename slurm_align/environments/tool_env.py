"""The tool environment: the model calls tools until it answers; the answer gets the rule reward.

Each model turn is parsed for `<tool_call>` blocks (tool_calls.py). A turn without any is the
answer: reward = reward.rule of its text, done. A turn with calls gets one `tool` message per
call, in order; everything that can go wrong with a call (not JSON, unknown tool, arguments
that do not fit the tool's parameters, the tool raising or returning something that is not
text, the call exceeding tool_timeout_s) is an error observation the model reads
("error: ..."), never an exception. At the max_turns-th model turn the conversation ends
whatever the turn holds (its calls are not run: no turn would read their answers), scored as
the answer and counted in metrics as truncated.

Calls run in a thread pool (ToolRunner): step_batch submits the calls of every conversation's
turn at once, so a slow call delays only its own conversation's reply, not the others' calls;
the pool's threads wait on tool subprocesses (python) without holding the GIL.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from slurm_align.environments.base import EnvironmentContext, Messages, Row, StepResult, attributed
from slurm_align.environments.rule_env import RuleEnvironment, last_model_text
from slurm_align.environments.tool_calls import BadCall, ToolCall, parse_tool_calls
from slurm_align.environments.tools import Tool, check_arguments, load_tools

MAX_OUTPUT_CHARS = 8192
"""A tool's answer is cut to this many characters (it takes the model's context)."""


@dataclass(frozen=True)
class CallOutcome:
    text: str
    ok: bool
    seconds: float = 0.0
    timed_out: bool = False


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, list, dict)) and not isinstance(value, bool):
        return json.dumps(value)
    raise TypeError(f"returned {type(value).__name__}, not text")


class ToolRunner:
    """Runs tool calls in a pool of threads, each with a timeout counted from its start.

    A call that times out is abandoned (a thread cannot be killed): it gets an error outcome
    and its thread runs on; when as many threads are stuck as the pool has, a fresh pool takes
    the calls still queued, so stuck tools cannot starve the others."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = workers, timeout_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tool")
        self._abandoned: list[Future] = []      # timed-out calls of the current pool

    def _stuck(self) -> int:
        """Threads of the current pool still held by abandoned calls."""
        self._abandoned = [f for f in self._abandoned if not f.done()]
        return len(self._abandoned)

    def run_all(self, jobs: Sequence[Callable[[], str]]) -> list[CallOutcome]:
        started: dict[int, float] = {}
        outcomes: dict[int, CallOutcome] = {}

        def timed(i: int, job: Callable[[], str]) -> CallOutcome:
            started[i] = time.monotonic()
            try:
                text, ok = _as_text(job()), True
            except Exception as e:
                text, ok = f"{type(e).__name__}: {e}", False
            return CallOutcome(text, ok, time.monotonic() - started[i])

        futures: dict[Future, int] = {self._pool.submit(timed, i, job): i for i, job in enumerate(jobs)}
        while futures:
            now = time.monotonic()
            for f, i in list(futures.items()):
                if f.done():
                    outcomes[i] = f.result()
                    del futures[f]
                elif i in started and now - started[i] >= self.timeout_s:
                    outcomes[i] = CallOutcome(f"timed out after {self.timeout_s:g} s", False, now - started[i], True)
                    del futures[f]
                    self._abandoned.append(f)
            if futures and self._stuck() >= self.workers:
                futures = self._fresh_pool(futures, timed, jobs)
            if not futures:
                break
            deadlines = [started[i] + self.timeout_s for i in futures.values() if i in started]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else self.timeout_s
            wait(list(futures), timeout=timeout, return_when=FIRST_COMPLETED)
        return [outcomes[i] for i in range(len(jobs))]

    def _fresh_pool(self, futures: dict[Future, int], timed, jobs) -> dict[Future, int]:
        """A new pool for the calls not yet started (the old one's threads are all stuck)."""
        old, self._pool = self._pool, ThreadPoolExecutor(self.workers, thread_name_prefix="tool")
        self._abandoned = []
        old.shutdown(wait=False, cancel_futures=False)    # its stuck threads end when their calls do
        moved = {}
        for f, i in futures.items():
            moved[self._pool.submit(timed, i, jobs[i]) if f.cancel() else f] = i
        return moved

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def error_message(name: str | None, problem: str) -> dict[str, Any]:
    message = {"role": "tool", "content": f"error: {problem}"}
    if name:
        message["name"] = name
    return message


class ToolEnvironment(RuleEnvironment):
    """Tools from settings.tools; the final answer scored by reward.rule."""

    name = "tools"

    def __init__(self, ctx: EnvironmentContext, tools: dict[str, Tool] | None = None):
        super().__init__(ctx)
        self.tool_map = load_tools(ctx.settings, ctx.run_dir) if tools is None else tools
        self.runner = ToolRunner(ctx.settings.tool_workers, ctx.settings.tool_timeout_s)

    def tools(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tool_map.values()]

    def step(self, messages: Messages, row: Row) -> StepResult:
        return self.step_batch([(messages, row)])[0]

    def _job(self, call: ToolCall | BadCall) -> Callable[[], str] | str:
        """The call as a job for the pool, or the problem that stops it from running."""
        if isinstance(call, BadCall):
            return call.problem
        tool = self.tool_map.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; the tools are: {', '.join(self.tool_map) or 'none'}"
        problems = check_arguments(tool.parameters, call.arguments)
        if problems:
            return f"bad arguments for tool {call.name!r}: {'; '.join(problems)}"
        return lambda: tool.run(**call.arguments)

    def step_batch(self, items: Sequence[tuple[Messages, Row]]) -> list[StepResult]:
        plans: list[tuple[str, list]] = []
        for messages, row in items:
            text = attributed(self, row, "step", functools.partial(last_model_text, messages))
            turns = sum(m.get("role") == "assistant" for m in messages)
            _, calls = parse_tool_calls(text)
            plans.append((text, calls if calls and turns < self.settings.max_turns else []))
        # every conversation's runnable calls go to the pool together
        jobs = {(ci, k): self._job(c) for ci, (_, calls) in enumerate(plans) for k, c in enumerate(calls)}
        runnable = {key: job for key, job in jobs.items() if callable(job)}
        outcomes = dict(zip(runnable, self.runner.run_all(list(runnable.values()))))
        results = []
        for ci, ((_messages, row), (text, calls)) in enumerate(zip(items, plans)):
            if not calls:
                _, parsed = parse_tool_calls(text)
                reward = attributed(self, row, "the rule reward", functools.partial(self.score, text, row))
                results.append(StepResult([], reward=reward, done=True,
                                          metrics={"truncated": float(bool(parsed))}))
                continue
            replies, errors, seconds, timeouts = [], 0, 0.0, 0
            for k, call in enumerate(calls):
                name = call.name if isinstance(call, ToolCall) else None
                job = jobs[(ci, k)]
                if not callable(job):
                    replies.append(error_message(name, job))
                    errors += 1
                    continue
                out = outcomes[(ci, k)]
                seconds += out.seconds
                timeouts += out.timed_out
                if out.ok:
                    replies.append({"role": "tool", "name": name, "content": _cut(out.text)})
                else:
                    errors += 1
                    what = out.text if out.timed_out else f"raised {out.text}"
                    replies.append(error_message(name, f"tool {name!r} {what}"))
            results.append(StepResult(replies, reward=0.0, done=False, metrics={
                "tool_calls": float(len(calls)), "tool_errors": float(errors), "tool_time_s": seconds,
                "tool_timeouts": float(timeouts)}))
        return results

    def close(self) -> None:
        self.runner.close()


def _cut(text: str) -> str:
    if len(text) <= MAX_OUTPUT_CHARS:
        return text
    return text[:MAX_OUTPUT_CHARS] + f"\n[cut: {len(text) - MAX_OUTPUT_CHARS} more characters]"

