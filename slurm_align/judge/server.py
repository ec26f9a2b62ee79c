"""The judge's endpoints on the critic's secured PyTriton channel (critic/server.py): the same
Triton gate token, the same check of the run's secret on every request before anything of it is
read, the same refusal log, bind and restart rules. Only the endpoints differ:

- judge_answers: `prompts` (judging prompts, text) and `answers` (the allowed answers, text, one
  token each of the judge's tokenizer) -> `logprobs` [n_prompts, n_answers] (verdict.py reads
  verdicts from them);
- judge_control: `command` = judge_shutdown.
The requests become the critic's "infer"/"shutdown" commands on the component's command channel
(the judge's ranks run one collective forward), executed by judge/main.py.
"""

from __future__ import annotations

import numpy as np

from slurm_align.critic import protocol as P
from slurm_align.critic.server import CriticServer, ServerLimits
from slurm_align.judge.model import JudgeModelError, answer_token_ids
from slurm_align.rundir import RunDir, read_run_secret

ANSWERS = "judge_answers"
CONTROL = "judge_control"
SHUTDOWN = "judge_shutdown"
MAX_PROMPTS = 4096


def _texts(endpoint: str, arr, what: str) -> list[str]:
    try:
        return [bytes(x).decode() for x in np.asarray(arr).reshape(-1)]
    except UnicodeDecodeError:
        raise P.CriticPayloadError(f"{endpoint}: {what} are not UTF-8 text") from None


class JudgeServer(CriticServer):
    def __init__(self, *args, encode, **kw):
        """`encode`: (encode(prompts) -> (tokens, lengths), the judge's tokenizer), from JudgeModel:
        requests are tokenized here, the answers' token ids checked."""
        super().__init__(*args, **kw)
        self._encode, self._tokenizer = encode

    @classmethod
    def for_judge(cls, rd: RunDir, host: str, port: int, limits: ServerLimits, model) -> JudgeServer:
        return cls(host, port, limits, secret=read_run_secret(rd), checkpoint_dir=rd.checkpoints("judge"),
                   run_dir=rd, component="judge", encode=(model.encode, model.tokenizer))

    def _bind(self, triton) -> None:
        from pytriton.model_config import ModelConfig, Tensor

        triton.bind(ANSWERS, self._answers,
                    inputs=[Tensor(name="prompts", dtype=np.bytes_, shape=(-1,)),
                            Tensor(name="answers", dtype=np.bytes_, shape=(-1,))],
                    outputs=[Tensor(name="logprobs", dtype=np.float32, shape=(-1, -1))],
                    config=ModelConfig(batching=False), strict=True)
        triton.bind(CONTROL, self._judge_control,
                    inputs=[Tensor(name="command", dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name="ack", dtype=np.int64, shape=(1,))],
                    config=ModelConfig(batching=False), strict=True)

    def _answers(self, requests) -> list[dict]:
        self._authorize(ANSWERS, requests)   # the secret first: nothing of a stranger's request is read
        out = []
        for r in requests:
            prompts = _texts(ANSWERS, r["prompts"], "prompts")
            answers = _texts(ANSWERS, r["answers"], "answers")
            if not prompts or len(prompts) > MAX_PROMPTS:
                raise P.CriticPayloadError(f"{ANSWERS}: {len(prompts)} prompts; expected 1 to {MAX_PROMPTS}")
            if not 2 <= len(answers) <= 16:
                raise P.CriticPayloadError(f"{ANSWERS}: {len(answers)} allowed answers; expected 2 to 16")
            try:
                ids = answer_token_ids(self._tokenizer, answers)
                tokens, lengths = self._encode(prompts)
            except JudgeModelError as e:
                raise P.CriticPayloadError(f"{ANSWERS}: {e}") from None
            logprobs = self._submit("infer", {"tokens": tokens.numpy(), "lengths": lengths.numpy(),
                                              "answer_ids": np.asarray(ids, np.int64)})
            out.append({"logprobs": np.asarray(logprobs, np.float32)})
        return out

    def _judge_control(self, requests) -> list[dict]:
        self._authorize(CONTROL, requests)
        for r in requests:
            cmd = _texts(CONTROL, r["command"], "command")
            if cmd != [SHUTDOWN]:
                raise P.CriticPayloadError(f"{CONTROL}: command {cmd!r}; expected {[SHUTDOWN]}")
            self._submit("shutdown", {})
        return [{"ack": np.array([1], np.int64)} for _ in requests]
