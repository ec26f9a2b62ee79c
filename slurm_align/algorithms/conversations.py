"""The multi-turn rollout loop: conversations with an environment, as token trajectories.

    convs = [Conversation.start(env, renderer, row, prompt_tokens, ...) for each sample]
    run_turns(convs, engine, params, ...)     # model turn for every live conversation, then the
                                              # environment (tools in its worker pool), until done
    batch = to_batch(convs, pad_id, rank)     # one sequence per conversation + per-token columns

Each engine call generates one turn for every live conversation, at most the turn budget
(environment.max_turn_tokens, default generation.max_new_tokens) and what is left of the total
budget (environment.max_total_tokens, default model.max_seq_len less the prompt). A turn ends
at EOS or at the first stop sequence (environment.stop_sequences): the torch engines and vLLM stop at a
stop sequence's tokens, and the turn is cut by text after the token that completes one (exact
for any tokenization and for engines without stop sequences; tokens past it are dropped, not
trained). Then the environment steps every live conversation at once (its step_batch: the
tool environment runs all their calls in its pool), inside a `tools` span. A conversation ends
when the environment says done, after environment.max_turns model turns, or when a budget is
spent (then is_end is False: truncated). Its reward is the sum of the environment's rewards.

The trajectory (environments/loss_mask.py) is the prompt, then every turn's tokens; per response
token the batch carries `loss_mask` (1 on the model's tokens), `turn` (the turn's number) and
`role` (ROLE_CODES), and the engine's log-probs of the model's tokens (0 on the environment's).
An environment that raises stops the run (EnvironmentStepError names it and the data row).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.environments.base import Environment, Messages, checked_reset, step_all
from slurm_align.environments.loss_mask import MODEL, Turn, build_trajectory, loss_mask_tensor
from slurm_align.environments.render import TurnRenderer
from slurm_align.profiling import phases as P

ROLE_CODES = {MODEL: 0, "tool": 1, "user": 2, "system": 3}
"""The per-token `role` column: which kind of turn a response token belongs to."""


@dataclass
class Conversation:
    row: dict[str, Any]
    prompt: list[int]
    messages: Messages
    chat: bool
    seed: int
    turns: list[Turn] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)   # per response token (0 on the environment's)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    model_turns: int = 0
    done: bool = False
    ended: bool = False          # done by the environment after a turn that ended properly

    @classmethod
    def start(cls, env: Environment, renderer: TurnRenderer, row: dict[str, Any],
              prompt: Sequence[int] | np.ndarray, seed: int) -> Conversation:
        """The environment's first messages; a chat row's prompt re-rendered from them (with the
        tools' schemas), a plain row's kept as the dataset encoded it."""
        messages = checked_reset(env, row)
        chat = isinstance(row.get("messages"), list)
        tokens = renderer.prompt(messages) if chat else [int(t) for t in prompt]
        return cls(row, tokens, messages, chat, seed)

    @property
    def used(self) -> int:
        return len(self.logprobs)

    def context(self) -> list[int]:
        return self.prompt + [t for turn in self.turns for t in turn.tokens]

    def add(self, role: str, tokens: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        if not len(tokens):
            return
        self.turns.append(Turn(role, [int(t) for t in tokens]))
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)


def stop_cut(tokenizer, tokens: Sequence[int], stops: Sequence[str]) -> int | None:
    """Length of the shortest prefix of `tokens` whose text holds a stop sequence (None: none
    does). Binary search: a prefix's text holding one stays so as it grows."""
    has = lambda n: any(s in tokenizer.decode(list(tokens[:n])) for s in stops)  # noqa: E731
    if not stops or not has(len(tokens)):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has(mid) else (mid + 1, hi)
    return lo


def stop_token_ids(tokenizer, stops: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The stop sequences as token ids, the engines' SamplingParams.stop_token_sequences (they end a
    turn inside the torch engines and vLLM; inside TensorRT-LLM only one-token ones, longer ones
    are cut here, stop_cut)."""
    return tuple(tuple(ids) for ids in (tokenizer.encode(s) for s in stops) if ids)


def run_turns(convs: list[Conversation], *, engine, params, tokenizer, env: Environment, renderer: TurnRenderer,
              settings, max_seq_len: int, tracer=None, step: int | None = None) -> None:
    """Every conversation to its end (see the module doc)."""
    turn_budget = settings.max_turn_tokens or params.max_new_tokens
    # The engine stops a turn at a stop sequence's tokens; the cut by text below stays the exact
    # check (another tokenization of the same text, engines without stop sequences).
    stop_ids = stop_token_ids(tokenizer, settings.stop_sequences)

    def room(c: Conversation) -> int:
        total = settings.max_total_tokens or (max_seq_len - len(c.prompt))
        return min(total - c.used, max_seq_len - len(c.prompt) - c.used)

    def span(phase):
        return tracer.span(phase, step) if tracer is not None and step is not None else contextlib.nullcontext()

    turn = 0
    while True:
        for c in convs:
            if not c.done and room(c) <= 0:
                c.done = True                      # the total budget is spent: truncated
        live = [c for c in convs if not c.done]
        if not live:
            return
        n_new = min(turn_budget, min(room(c) for c in live))
        call = dataclasses.replace(params, max_new_tokens=max(1, n_new), stop_token_sequences=stop_ids)
        seeds = [(c.seed + 1_000_003 * turn) % (2**62) for c in live]
        with span(P.GENERATE):
            out = engine.generate([torch.tensor(c.context(), dtype=torch.int64) for c in live], call, seeds=seeds)
        lps = out.logprobs
        items, stopped = [], []
        for i, (c, resp) in enumerate(zip(live, out.responses())):
            toks = resp.tolist()
            lp = lps[i, :len(toks)].float().tolist() if lps is not None else [0.0] * len(toks)
            cut = stop_cut(tokenizer, toks, settings.stop_sequences)
            ended_here = bool(out.is_end[i]) or cut is not None
            n = min(len(toks) if cut is None else cut, room(c))
            ended_here = ended_here and n == (len(toks) if cut is None else cut)
            c.add(MODEL, toks[:n], lp[:n])
            c.model_turns += 1
            text = tokenizer.decode(toks[:n])          # decode drops EOS (a special)
            c.messages.append({"role": "assistant", "content": text})
            items.append((c.messages, c.row))
            stopped.append(ended_here)
        with span(P.TOOLS):
            results = step_all(env, items)
        for c, r, ended_here in zip(live, results, stopped):
            c.reward += float(r.reward)
            for k, v in r.metrics.items():
                c.metrics[k] = c.metrics.get(k, 0.0) + float(v)
            if r.done:
                c.done, c.ended = True, ended_here
                continue
            if c.model_turns >= settings.max_turns:
                c.done = True                      # out of turns: truncated
                continue
            reply = renderer.reply(c.messages, r.messages, c.chat)
            keep = min(len(reply), room(c))
            c.add(r.messages[0]["role"] if r.messages else "env", reply[:keep])
            c.messages.extend(r.messages)
            if keep < len(reply):
                c.done = True                      # the reply does not fit the budget: truncated
        turn += 1


def to_batch(convs: list[Conversation], pad_id: int, *, index: Sequence[int], group: Sequence[int],
             rank: int) -> RolloutBatch:
    """The conversations as a RolloutBatch: everything after the prompt is the "response"; the
    multi-turn columns ride along (module doc). Per sample: rule_reward (the return), turns,
    and the environment's metrics summed over turns (tool_calls, tool_errors, ...)."""
    trajs = [build_trajectory(c.prompt, c.turns) for c in convs]
    mb = RolloutBatch.from_sequences([t.tokens[:t.prompt_length] for t in trajs],
                                     [t.tokens[t.prompt_length:] for t in trajs], pad_id, index=list(index),
                                     group=list(group), is_end=np.array([c.ended for c in convs]),
                                     rank=[rank] * len(convs))
    T = mb.max_response
    lp = torch.zeros(len(convs), T)
    turn_col, role_col = torch.zeros(len(convs), T), torch.zeros(len(convs), T)
    for i, (c, t) in enumerate(zip(convs, trajs)):
        lp[i, :t.response_length] = torch.tensor(c.logprobs, dtype=torch.float32)
        bounds = [*t.turn_starts, t.response_length]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            turn_col[i, a:b] = k
            role_col[i, a:b] = ROLE_CODES.get(t.turn_roles[k], ROLE_CODES["user"])
    mb.set_tokens("rollout_logprobs", lp)
    mb.set_tokens("loss_mask", loss_mask_tensor(trajs, T))
    mb.set_tokens("turn", turn_col)
    mb.set_tokens("role", role_col)
    mb.set_samples("rule_reward", np.array([c.reward for c in convs], np.float32))
    mb.set_samples("turns", np.array([c.model_turns for c in convs], np.int64))
    for name in ("tool_calls", "tool_errors", "tool_time_s"):
        mb.set_samples(name, np.array([c.metrics.get(name, 0.0) for c in convs], np.float32))
    return mb
