"""A judge served elsewhere: an OpenAI-compatible HTTP service (`vllm serve`, a hosted API).

Each judging prompt is one POST URL/completions {"model", "prompt", "max_tokens": 1,
"temperature": 0, "logprobs": top_logprobs}; the verdict is read from the answer position's top
log-probs (`choices[0].logprobs.top_logprobs[0]`, whitespace around a token ignored) when the
allowed answers are among them, else parsed from the text (`choices[0].text`). The API key is
read from the environment variable the config names (judge.remote.api_key_env) when a request is
made, sent as `Authorization: Bearer ...`, and never logged: error messages name the variable.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from collections.abc import Sequence

from slurm_align.config.run import RemoteJudgeConfig
from slurm_align.judge.client import Answer, JudgeError


class RemoteJudge:
    def __init__(self, cfg: RemoteJudgeConfig):
        self.cfg = cfg

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key_env:
            key = os.environ.get(self.cfg.api_key_env)
            if not key:
                raise JudgeError(f"judge.remote.api_key_env={self.cfg.api_key_env!r}: the environment "
                                 "variable is not set (or empty); export it where the job runs")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _complete(self, prompt: str) -> dict:
        url = self.cfg.url.rstrip("/") + "/completions"
        body = json.dumps({"model": self.cfg.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                           "logprobs": self.cfg.top_logprobs}).encode()
        req = urllib.request.Request(url, data=body, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            hint = (f" (check the key in ${self.cfg.api_key_env})" if e.code in (401, 403) and self.cfg.api_key_env
                    else "")
            raise JudgeError(f"remote judge {url}: HTTP {e.code}{hint}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise JudgeError(f"remote judge {url}: {type(e).__name__}: {getattr(e, 'reason', e)} "
                             f"(judge.remote.timeout_s={self.cfg.timeout_s:g})") from None

    def answer_logprobs(self, prompts: Sequence[str], answers: Sequence[str]) -> list[Answer]:
        out: list[Answer] = []
        for prompt in prompts:
            choice = self._complete(prompt)["choices"][0]
            top = ((choice.get("logprobs") or {}).get("top_logprobs") or [{}])[0] or {}
            found: dict[str, float] = {}
            for token, lp in top.items():
                t = token.strip()
                if t in answers and math.isfinite(lp):
                    found[t] = max(lp, found.get(t, -math.inf))
            out.append(found if found else str(choice.get("text", "")))
        return out
