"""Task evaluation during a rollout run: greedy responses to held-out prompts, scored by a rule.

The task's own score, beside the reward: a policy that pleases a reward model without solving
the task shows here. `eval.interval` sets how often; results are `val/score` (the scorer's
mean) and `val/response_length` in metrics.jsonl. Multi-turn runs (run.multi_turn) run the
rollouts' loop greedily with the environment and score the model's last turn; the length counts
the model's tokens only, and `val/tool_calls` is the mean number of tool calls per answer.

Runs in the generation layout after a refit: each generation replica takes a strided share of
the prompts (all its ranks in lock-step, as for rollouts), its requester scores them, and one
all-reduce over the component gives every rank the means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import PromptDataset
from slurm_align.rewards.rule import RuleReward


@dataclass
class EvalSet:
    rows: list[dict[str, Any]]       # held-out prompt rows (prompt + the fields the scorer reads)
    prompts: list[np.ndarray]        # their token ids, encoded as the rollout prompts are
    scorer: RuleReward

    @classmethod
    def from_run(cls, run: RunConfig, tokenizer) -> EvalSet | None:
        """None when evaluation is off. Prompts are encoded as the rollout prompts are."""
        ev = run.eval
        if not ev.interval:
            return None
        scorer = ev.scorer or run.reward.rule
        # RunConfig: eval.interval needs eval.val_path and a scorer
        assert ev.val_path is not None and scorer is not None, "checked by RunConfig"
        dataset = PromptDataset(ev.val_path, tokenizer, run.model.max_seq_len)
        rows, prompts = dataset.fields(), dataset.token_arrays()
        if ev.num_prompts:
            rows, prompts = rows[: ev.num_prompts], prompts[: ev.num_prompts]
        return cls(rows, prompts, RuleReward.load(scorer))

    def due(self, run: RunConfig, step: int) -> bool:
        """After step k when k is a multiple of eval.interval, and after the last step (the
        initial policy is evaluated too, as step 0)."""
        return step % run.eval.interval == 0 or step == run.ppo.num_steps


@torch.no_grad()
def evaluate(collector, layout, comm, evalset: EvalSet, max_new_tokens: int, batch_size: int) -> dict[str, float]:
    """Collective over `comm` (the component's world), inside `generation_layout`, the
    collector's engine refitted (algorithms/rollout_collector.py: its greedy engine call)."""
    mine = list(range(layout.dp_rank, len(evalset.rows), layout.dp_size))
    total = np.zeros(4)          # score sum, response tokens, responses, tool calls
    for a in range(0, len(mine), batch_size):
        idx = mine[a:a + batch_size]
        if collector.env is not None:   # multi-turn: the same loop as the rollouts, greedy
            convs = collector.greedy_conversations([evalset.prompts[i] for i in idx], [evalset.rows[i] for i in idx])
            texts = [c.messages[-1]["content"] for c in convs]     # the answer: the model's last turn
            scores = evalset.scorer.many(texts, [evalset.rows[i] for i in idx])
            total += [sum(scores), sum(len(t.tokens) for c in convs for t in c.turns if t.role == "model"),
                      len(idx), sum(c.metrics.get("tool_calls", 0.0) for c in convs)]
            continue
        out = collector.greedy([evalset.prompts[i] for i in idx], max_new_tokens)
        if not layout.is_requester:
            continue             # the replica's other ranks ran the same batch in lock-step
        responses = out.responses()
        texts = [collector.tokenizer.decode(r.tolist()) for r in responses]   # decode drops EOS (a special)
        lengths = [len(r) for r in responses]
        scores = evalset.scorer.many(texts, [evalset.rows[i] for i in idx])
        total += [sum(scores), sum(lengths), len(idx), 0.0]
    score, tokens, count, calls = comm.allreduce(total)
    count = max(count, 1.0)
    out = {"val/score": score / count, "val/response_length": tokens / count}
    if collector.env is not None:
        out["val/tool_calls"] = calls / count
    return out
