"""One interface for every judge: `Judge.answer_logprobs(prompts, answers)` -> per prompt, the
log-probs of the allowed answers it could read (a dict; an answer missing from a remote service's
top log-probs is absent) or, when a service returned only text, that text (verdict.py parses it).

- ComponentJudge: the run's judge component (judge/server.py), over the critic's secured
  channel: the run's secret on every request, the address the judge published in the run dir.
- LocalJudge: a JudgeModel in this process (tests, a labelling job's own ranks).
- RemoteJudge (remote.py): an OpenAI-compatible service.

`pairwise_probs` and `pointwise_scores` turn them into verdicts over the configured principles.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from slurm_align.critic import protocol as P
from slurm_align.judge import verdict as V
from slurm_align.judge.prompts import (
    PAIRWISE_ANSWERS,
    POINTWISE_ANSWERS,
    JudgeTemplate,
    pairwise_prompt,
    pointwise_prompt,
)
from slurm_align.judge.server import ANSWERS, CONTROL, SHUTDOWN
from slurm_align.rundir import RunDir, address_problem, read_run_secret

Answer = dict[str, float] | str


class JudgeError(RuntimeError):
    """A judge request failed: the message names where and why."""


class Judge(Protocol):
    def answer_logprobs(self, prompts: Sequence[str], answers: Sequence[str]) -> list[Answer]: ...


class LocalJudge:
    def __init__(self, model):
        self.model = model

    def answer_logprobs(self, prompts: Sequence[str], answers: Sequence[str]) -> list[Answer]:
        lp = self.model.answer_logprobs(prompts, answers)
        return [dict(zip(answers, map(float, row))) for row in lp]


class ComponentJudge:
    """The run's judge component (its published address, its run's secret)."""

    def __init__(self, run_dir: str | Path, *, connect_timeout_s: float = 120.0, request_timeout_s: float = 300.0):
        self.rd = RunDir(Path(run_dir))
        self._secret = read_run_secret(self.rd)
        self.connect_timeout_s, self.request_timeout_s = connect_timeout_s, request_timeout_s
        self.url: str | None = None

    def connect(self) -> str:
        """Wait (with backoff) for the judge's address and its endpoints to be ready."""
        if self.url is not None:
            return self.url
        deadline, delay, last = time.monotonic() + self.connect_timeout_s, 0.05, "no answer yet"
        while True:
            found, why = address_problem(self.rd, "judge", self._secret)
            if found is None:
                last = why
            else:
                url = f"{found[0]}:{found[1]}"
                try:
                    for ep in (ANSWERS, CONTROL):
                        req = urllib.request.Request(f"http://{url}/v2/models/{ep}/ready",
                                                     headers=P.auth_headers(self._secret))
                        with urllib.request.urlopen(req, timeout=2.0):
                            pass
                    self.url = url
                    return url
                except (urllib.error.URLError, OSError) as e:
                    last = str(getattr(e, "reason", e))
            if time.monotonic() > deadline:
                raise JudgeError(f"judge of {self.rd.root}: not ready after {self.connect_timeout_s:g} s; "
                                 f"last error: {last}")
            time.sleep(delay)
            delay = min(2 * delay, 2.0)

    def _infer(self, endpoint: str, inputs: dict[str, np.ndarray], output: str) -> np.ndarray:
        import tritonclient.http as th  # deferred: tritonclient start-up cost
        from tritonclient.utils import InferenceServerException, np_to_triton_dtype

        url = self.connect()
        reqs = []
        for name, arr in inputs.items():
            inp = th.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(arr, binary_data=True)
            reqs.append(inp)
        client = th.InferenceServerClient(url=url, connection_timeout=self.request_timeout_s,
                                          network_timeout=self.request_timeout_s)
        try:
            res = client.infer(endpoint, reqs, headers=dict(P.auth_headers(self._secret)),
                               outputs=[th.InferRequestedOutput(output, binary_data=True)])
        except InferenceServerException as e:
            raise JudgeError(f"judge at {url}, endpoint {endpoint}: {e.message() or e}") from None
        finally:
            client.close()
        return res.as_numpy(output)

    def answer_logprobs(self, prompts: Sequence[str], answers: Sequence[str]) -> list[Answer]:
        lp = self._infer(ANSWERS, {"prompts": np.array([p.encode() for p in prompts], dtype=np.object_),
                                   "answers": np.array([a.encode() for a in answers], dtype=np.object_)},
                         "logprobs")
        return [dict(zip(answers, map(float, row))) for row in lp]

    def shutdown(self) -> None:
        self._infer(CONTROL, {"command": np.array([SHUTDOWN.encode()], dtype=np.object_)}, "ack")


def _pairwise(answer: Answer) -> float:
    return V.pairwise_from_text(answer) if isinstance(answer, str) else V.pairwise_from_logprobs(answer)


def pairwise_probs(judge: Judge, template: JudgeTemplate, principles: Sequence[str],
                   items: Sequence[tuple[str, str, str]], *, both_orders: bool = True) -> np.ndarray:
    """p(a is better than b) for each (prompt, a, b): p('A') averaged over the principles and,
    with `both_orders`, over (a, b) and (b, a) (1 - p('A') of the swapped pair), which cancels a
    judge's preference for a position."""
    prompts, sign = [], []
    for principle in principles:
        for prompt, a, b in items:
            prompts.append(pairwise_prompt(template, principle, prompt, a, b))
            sign.append(False)
            if both_orders:
                prompts.append(pairwise_prompt(template, principle, prompt, b, a))
                sign.append(True)
    got = judge.answer_logprobs(prompts, PAIRWISE_ANSWERS)
    p = np.array([1.0 - _pairwise(g) if s else _pairwise(g) for g, s in zip(got, sign)])
    return p.reshape(len(principles), len(items), 2 if both_orders else 1).mean(axis=(0, 2))


def pointwise_scores(judge: Judge, template: JudgeTemplate, principles: Sequence[str],
                     items: Sequence[tuple[str, str]]) -> np.ndarray:
    """The score in [0, 1] of each (prompt, response), averaged over the principles."""
    prompts = [pointwise_prompt(template, principle, prompt, response)
               for principle in principles for prompt, response in items]
    got = judge.answer_logprobs(prompts, POINTWISE_ANSWERS)
    s = np.array([V.pointwise_from_text(g, POINTWISE_ANSWERS) if isinstance(g, str)
                  else V.pointwise_from_logprobs(g, POINTWISE_ANSWERS) for g in got])
    return s.reshape(len(principles), len(items)).mean(axis=0)
