"""Task evaluation during a rollout run: greedy responses to held-out prompts, scored by a rule.

The task's own score, beside the reward: a policy that pleases a reward model without solving
the task shows here. `eval.interval` sets how often; results are `val/score` (the scorer's
mean) and `val/response_length` in metrics.jsonl. Multi-turn runs (run.multi_turn) run the
rollouts' loop greedily with the environment and score the model's last turn; the length counts
the model's tokens only, and `val/tool_calls` is the mean number of tool calls per answer.

Each evaluation also keeps its per-prompt outcome, RUN_DIR/eval/step_<N>.jsonl (N: the steps
trained before it, 0 for the initial policy; RunDir.eval_results), one JSON line per held-out
prompt in index order:

    {"index": 17, "prompt": "7391=", "response": "1379", "score": 1.0, "correct": 1}

`index` is the prompt's place in the evaluated set (the first eval.num_prompts rows of
eval.val_path, in file order), `response` the greedy answer as scored (multi-turn: the model's
last turn), `score` the scorer's value and `correct` 1 where it gave its full mark (score >= 1;
the shipped exact scorers give 0 or 1), else 0. The mean of `score` is that step's val/score.
Two evaluations of the same set pair prompt by prompt (`slurm_align.analysis.significance`: which
prompts changed, and an exact sign test of whether a change is more than chance). The file is
written whole (temp file, then os.replace), so a reader never sees part of one; a resumed run
rewrites the steps it redoes.

Sampled evaluation (eval.samples N > 1, or eval.temperature > 0; also `slurm-align eval`): N
answers per prompt at eval.temperature, each with its own seed (rollout_collector.sample_seed,
keyed apart from the training steps). The metrics add val/pass@k for k = 1, 2, 4, ... up to N
(the unbiased estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k), with c the prompt's correct
answers, averaged over prompts) and val/majority (the most frequent answer's correctness). Each
per-prompt row then also holds every sample ("samples": [{"response", "score", "correct"}]),
"n" and "num_correct"; its "response"/"score"/"correct" are those of the majority answer, so
the rows pair for the sign tests as greedy ones do.

Runs in the generation layout after a refit: the generation replicas take batches of prompts
from the work-stealing prompt server as rollouts do (balance/prompts.py; switches.dynamic_prompts
off: a strided static share each), all of a replica's ranks in lock-step, its requester scores
them (an answer's seed is a function of its prompt and sample, so who draws it does not matter),
and one
all-reduce over the component gives every rank the means; the per-prompt rows are gathered on
the component's rank 0, which writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slurm_align.algorithms.rollout_collector import sample_seed
from slurm_align.algorithms.steerlm import prompt_suffix
from slurm_align.balance.replica import open_prompt_source, replica_batches
from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import PromptDataset
from slurm_align.parallel import quiet
from slurm_align.rewards.rule import RuleReward
from slurm_align.rundir import write_atomic

FULL_MARK = 1.0
"""A prompt is `correct` where its score reaches this (the exact scorers' 1)."""
EVAL_DRAWS = 1 << 40
"""The `draws` key of sampled evaluation's per-sample seeds: apart from every training step's."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples with c correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct
    one. Exact integers (math.comb), then one division."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    return sorted({*(1 << i for i in range(n.bit_length()) if 1 << i < n), n})


def majority(texts: Sequence[str]) -> int:
    """Index of the majority answer (the most frequent stripped text; ties: the first seen)."""
    counts = Counter(t.strip() for t in texts)
    best = max(counts.values())
    return next(i for i, t in enumerate(texts) if counts[t.strip()] == best)


def prompt_summary(index: int, prompt: str, texts: Sequence[str], scores: Sequence[float]) -> dict[str, Any]:
    """One prompt's row of a sampled evaluation (see the module's docstring)."""
    correct = [int(s >= FULL_MARK) for s in scores]
    m = majority(texts)
    n, c = len(texts), sum(correct)
    return {"index": index, "prompt": prompt, "response": texts[m], "score": float(scores[m]), "correct": correct[m],
            "n": n, "num_correct": c, "mean_score": float(np.mean(scores)),
            **{f"pass@{k}": pass_at_k(n, c, k) for k in pass_ks(n)},
            "samples": [{"response": t, "score": float(s), "correct": ok}
                        for t, s, ok in zip(texts, scores, correct)]}


def sampled_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """val/pass@k, val/score (mean over every sample), val/majority over per-prompt rows."""
    n = rows[0]["n"]
    out = {f"val/pass@{k}": float(np.mean([r[f"pass@{k}"] for r in rows])) for k in pass_ks(n)}
    out["val/score"] = float(np.mean([r["mean_score"] for r in rows]))
    out["val/majority"] = float(np.mean([r["correct"] for r in rows]))
    return out


@dataclass
class EvalSet:
    rows: Sequence[dict[str, Any]]     # held-out prompt rows (prompt + the fields the scorer reads)
    prompts: Sequence[np.ndarray]    # their token ids, encoded as the rollout prompts are (on first use)
    scorer: RuleReward
    samples: int = 1                 # answers per prompt (eval.samples)
    temperature: float = 0.0         # 0: greedy (eval.temperature)
    seed: int = 0                    # the run's seed: sampled answers' seeds derive from it

    @property
    def sampled(self) -> bool:
        return self.samples > 1 or self.temperature > 0

    @classmethod
    def from_run(cls, run: RunConfig, tokenizer) -> EvalSet | None:
        """None when evaluation is off. Prompts are encoded as the rollout prompts are."""
        ev = run.eval
        if not ev.interval:
            return None
        scorer = ev.scorer or run.reward.rule
        # RunConfig: eval.interval needs eval.val_path and a scorer
        assert ev.val_path is not None and scorer is not None, "checked by RunConfig"
        dataset = PromptDataset(ev.val_path, tokenizer, run.model.max_seq_len, run.data.columns,
                                reserve=run.generation.max_new_tokens, suffix=prompt_suffix(ev.attributes))
        rows, prompts = dataset.fields(), dataset.token_arrays()
        if ev.num_prompts:
            rows, prompts = rows[: ev.num_prompts], prompts[: ev.num_prompts]
        return cls(rows, prompts, RuleReward.load(scorer), ev.samples, ev.temperature, run.seed)

    def due(self, run: RunConfig, step: int) -> bool:
        """After step k when k is a multiple of eval.interval, and after the last step (the
        initial policy is evaluated too, as step 0)."""
        return step % run.eval.interval == 0 or step == run.ppo.num_steps


def write_results(path: Path, rows: list[dict[str, Any]]) -> None:
    """One evaluation's per-prompt rows (see the module's docstring) to `path`
    (RunDir.eval_results), written whole; analysis/significance.py reads them."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


@dataclass
class EvalResult:
    metrics: dict[str, float]                 # val/* means, on every rank
    rows: list[dict[str, Any]] | None         # per-prompt rows in index order; on comm rank 0 only


def prompt_batches(collector, layout, comm, n: int, batch_size: int) -> Iterator[list[int]]:
    """Collective over `comm`: batches of the n prompt indices for this rank's generation replica
    (every rank of a replica gets the same), from the work-stealing prompt server as the
    rollouts' (switches.dynamic_prompts off: a strided static share)."""
    source = open_prompt_source(comm, layout, n, dynamic=collector.run.switches.dynamic_prompts, strided=True)
    for batch in replica_batches(layout, source, batch_size):
        yield [int(i) for i in batch]
    source.close()   # collective: after every replica drained the server


@torch.no_grad()
def evaluate(collector, layout, comm, evalset: EvalSet, max_new_tokens: int, batch_size: int) -> EvalResult:
    """Collective over `comm` (the component's world), inside `generation_layout`, the
    collector's engine refitted (algorithms/rollout_collector.py: its greedy engine call)."""
    if evalset.sampled:
        return evaluate_sampled(collector, layout, comm, evalset, max_new_tokens, batch_size)
    total = np.zeros(4)          # score sum, response tokens, responses, tool calls
    scored: list[tuple[int, str, float]] = []    # (index, response, score) of the prompts this rank scored
    for idx in prompt_batches(collector, layout, comm, len(evalset.rows), batch_size):
        if collector.env is not None:   # multi-turn: the same loop as the rollouts, greedy
            convs = collector.greedy_conversations([evalset.prompts[i] for i in idx], [evalset.rows[i] for i in idx])
            texts = [c.messages[-1]["content"] for c in convs]     # the answer: the model's last turn
            scores = evalset.scorer.many(texts, [evalset.rows[i] for i in idx])
            total += [sum(scores), sum(len(t.tokens) for c in convs for t in c.turns if t.role == "model"),
                      len(idx), sum(c.metrics.get("tool_calls", 0.0) for c in convs)]
            scored += zip(idx, texts, scores)
            continue
        out = collector.greedy([evalset.prompts[i] for i in idx], max_new_tokens)
        if not layout.is_requester:
            continue             # the replica's other ranks ran the same batch in lock-step
        responses = out.responses()
        texts = [collector.tokenizer.decode(r.tolist()) for r in responses]   # decode drops EOS (a special)
        lengths = [len(r) for r in responses]
        scores = evalset.scorer.many(texts, [evalset.rows[i] for i in idx])
        total += [sum(scores), sum(lengths), len(idx), 0.0]
        scored += zip(idx, texts, scores)
    quiet.barrier(comm)   # ranks finish their share at different times: wait asleep
    score, tokens, count, calls = comm.allreduce(total)
    count = max(count, 1.0)
    out = {"val/score": score / count, "val/response_length": tokens / count}
    if collector.env is not None:
        out["val/tool_calls"] = calls / count
    # Multi-turn: every rank of a replica ran the loop; its requester's rows are the replica's.
    parts = comm.gather(scored if layout.is_requester else [], root=0)
    rows = None
    if parts is not None:
        rows = [{"index": i, "prompt": evalset.rows[i]["prompt"], "response": text, "score": float(s),
                 "correct": int(s >= FULL_MARK)} for i, text, s in sorted(p for part in parts for p in part)]
        assert [r["index"] for r in rows] == list(range(len(evalset.rows))), "every held-out prompt scored once"
    return EvalResult(out, rows)


@torch.no_grad()
def evaluate_sampled(collector, layout, comm, evalset: EvalSet, max_new_tokens: int, batch_size: int) -> EvalResult:
    """evaluate() with evalset.samples answers per prompt at evalset.temperature (module
    docstring): `batch_size` answers per engine call, a prompt's answers in one call; every
    answer's seed is a function of (run seed, prompt index, sample), so any layout draws the same."""
    if collector.env is not None:
        raise ValueError("sampled evaluation (eval.samples > 1 or eval.temperature > 0) is single-turn only; "
                         "multi-turn runs evaluate greedily")
    n = evalset.samples
    params = dataclasses.replace(collector.params, temperature=evalset.temperature, max_new_tokens=max_new_tokens,
                                 return_logprobs=False)
    scored: list[tuple[int, list[str], list[float]]] = []
    for idx in prompt_batches(collector, layout, comm, len(evalset.rows), max(1, batch_size // n)):
        flat = [i for i in idx for _ in range(n)]
        seeds = [sample_seed(evalset.seed, EVAL_DRAWS, i * n + j) for i in idx for j in range(n)]
        out = collector.engine.generate([torch.from_numpy(evalset.prompts[i]) for i in flat], params, seeds=seeds)
        if not layout.is_requester:
            continue
        texts = [collector.tokenizer.decode(r.tolist()) for r in out.responses()]
        scores = evalset.scorer.many(texts, [evalset.rows[i] for i in flat])
        scored += [(i, texts[p * n:(p + 1) * n], scores[p * n:(p + 1) * n]) for p, i in enumerate(idx)]
    quiet.barrier(comm)
    parts = comm.gather(scored if layout.is_requester else [], root=0)
    rows = None
    if parts is not None:
        rows = [prompt_summary(i, evalset.rows[i]["prompt"], texts, scores)
                for i, texts, scores in sorted(p for part in parts for p in part)]
        assert [r["index"] for r in rows] == list(range(len(evalset.rows))), "every held-out prompt scored once"
    metrics = comm.bcast(sampled_metrics(rows) if rows is not None else None, root=0)
    return EvalResult(metrics, rows)
