"""The rollout collector: from a step's prompts to finished, scored samples.

It owns what every producer of rollouts shares: the step's prompt order and per-sample seeds,
the engine calls, the rule reward and the dispatch of each finished micro-batch to the critic.
The colocated actor loop (algorithms/ppo.py), the disaggregated generator component
(algorithms/generator.py) and evaluation use it; it never touches the training weights (the
owner refits or streams weights into its engine, then calls `set_version`).

The small interface, for anything that builds rollouts of its own (multi-turn tool use):

    collector.generate_samples(prompts, index=..., group=..., rows=...)  -> RolloutBatch

a batch of prompt token arrays in, finished samples out: tokens, the engine's per-token
log-probs ('rollout_logprobs'), the rule reward ('rule_reward', when a rule is set), the judge's
score ('judge_score', reward.judge_weight) and the weight version that generated each sample ('version').

Multi-turn runs (run.multi_turn) take `generate_conversations` instead, the same interface: each
prompt a conversation with the run's environment (algorithms/conversations.py), the batch with
per-token loss_mask, turn and role; evaluation then uses `greedy_conversations`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from slurm_align.algorithms import conversations as mt
from slurm_align.algorithms.rollout_batch import RolloutBatch, rollout_logprobs
from slurm_align.balance.replica import open_prompt_source, replica_batches
from slurm_align.config.run import RunConfig
from slurm_align.environments.base import EnvironmentContext
from slurm_align.environments.registry import load_environment
from slurm_align.environments.render import TurnRenderer
from slurm_align.generation.params import SamplingParams
from slurm_align.parallel import quiet
from slurm_align.profiling import phases as P

VERSION = "version"
"""Per-sample column: the weight version (optimizer steps taken by the weights that generated it)."""


def sample_seed(run_seed: int, draws: int, index: int) -> int:
    """Per-sample sampling seed: the same sample draws the same tokens whoever generates it.
    `draws` keys the step (the number of steps before it)."""
    return (run_seed * 1_000_003 + draws * 100_003 + index) % (2**62)


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's overlong reward shaping: 0 up to max_new_tokens - buffer tokens, then falling
    linearly to -factor at max_new_tokens: factor x ((max_new_tokens - buffer) - length) / buffer
    (-factor past the maximum, which the engines never exceed)."""
    free = max_new_tokens - buffer
    over = np.clip(np.asarray(lengths, dtype=np.float64) - free, 0, None)
    return (-factor * np.minimum(over / buffer, 1.0)).astype(np.float32)


def varied_groups(mb: RolloutBatch) -> dict[int, bool]:
    """Per group of the batch, whether its rule rewards are not all equal (a group is whole in
    one micro-batch: its samples are generated together)."""
    rewards, groups = mb["rule_reward"].double(), mb["group"]
    out: dict[int, bool] = {}
    for g in torch.unique(groups).tolist():
        r = rewards[groups == g]
        out[int(g)] = bool(r.max() > r.min())
    return out


def prompt_order(run: RunConfig, num_prompts: int, step: int, round: int = 0) -> np.ndarray:
    """Dataset positions of step `step`'s num_rollout_samples prompt slots (a permutation, or a
    draw with replacement when the step wants more prompts than the data set has). `round` > 0:
    dynamic sampling's extra rounds of the step, each its own draw."""
    n = run.ppo.num_rollout_samples
    # keyed by the number of steps before it (and the round, past the first)
    rng = np.random.default_rng(run.seed + step - 1 if round == 0 else [run.seed, step, round])
    if n != num_prompts:
        return rng.choice(num_prompts, size=n, replace=n > num_prompts)
    return rng.permutation(n)


@dataclass
class Collected:
    """One rank's share of a step: its finished micro-batches and their critic futures (None
    without a critic). Empty on ranks that do not request prompts."""
    pending: list[tuple[RolloutBatch, Scores | None]] = field(default_factory=list)
    pad_id: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """Dynamic sampling's (rl.dynamic_sampling_max_rounds): rounds, kept and dropped groups."""

    @property
    def batch(self) -> RolloutBatch:
        return RolloutBatch.cat([mb for mb, _ in self.pending], self.pad_id)


@dataclass
class Scores:
    """The critic's and the teacher's futures of one micro-batch (either may be None)."""

    critic: Future | None
    teacher: Future | None

    def result(self) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(values, reward-model scores, teacher log-probs per position); None for an absent one."""
        values, scores = self.critic.result() if self.critic is not None else (None, None)
        return values, scores, self.teacher.result()[0] if self.teacher is not None else None


class RolloutCollector:
    """Generation of rollouts on one rank's engine (every rank of a generation replica calls
    the same methods in lock-step; only the replica's requester keeps the samples)."""

    def __init__(self, run: RunConfig, engine, tokenizer, prompts: Sequence[np.ndarray], rewards, *, rank: int,
                 tracer=None, critic=None, teacher=None):
        self.run, self.engine, self.tokenizer, self.prompts = run, engine, tokenizer, prompts
        self.rewards, self.rank, self.tracer, self.critic = rewards, rank, tracer, critic
        self.teacher = teacher   # on-policy distillation: a CriticClient of the teacher component
        self.pad_id = tokenizer.pad_id
        self.params = SamplingParams.from_config(run.generation, eos_id=tokenizer.eos_id, pad_id=self.pad_id)
        self.version = 0
        self.env = None   # multi-turn (run.multi_turn): the environment, built once per generating rank
        if run.multi_turn:
            self.env = load_environment(EnvironmentContext.for_run(run))
            self.renderer = TurnRenderer(tokenizer, self.env.tools())

    def set_version(self, version: int) -> None:
        """The engine now holds the weights after `version` optimizer steps."""
        self.version = int(version)

    # -- the small interface ----------------------------------------------------------------
    def generate_samples(self, prompts: Sequence[np.ndarray], *, index: Sequence[int], group: Sequence[int],
                         rows: Sequence[int] | None, seeds: Sequence[int] | None = None, keep: bool = True,
                         step: int | None = None) -> RolloutBatch | None:
        """One engine call on `prompts` (token arrays) with per-sample `seeds`; `index` (unique
        within the step), `group` (the prompt's group) and `rows` (data rows the rule reward
        reads; None: no rule reward) label the samples. None when not `keep` (a replica's
        follower rank, which runs the call in lock-step only)."""
        span = self.tracer.span(P.GENERATE, step) if self.tracer is not None else contextlib.nullcontext()
        with span:
            out = self.engine.generate([torch.from_numpy(p) for p in prompts], self.params,
                                       seeds=None if seeds is None else list(seeds))
        if not keep:
            return None
        mb = RolloutBatch.from_sequences(prompts, out.responses(), self.pad_id, index=list(index), group=list(group),
                                         is_end=out.is_end.numpy(), rank=[self.rank] * len(index))
        mb.set_tokens("rollout_logprobs", rollout_logprobs(out, mb.max_response))
        mb.set_samples(VERSION, [self.version] * len(index))
        rule = self.rewards.score(out.responses(), list(rows)) if rows is not None else None
        if rule is not None:
            if self.run.rl.overlong_buffer:   # DAPO's soft length penalty, part of the reward
                lengths = np.asarray([len(r) for r in out.responses()])
                rule = rule + overlong_penalty(lengths, self.run.generation.max_new_tokens,
                                               self.run.rl.overlong_buffer, self.run.rl.overlong_penalty)
            mb.set_samples("rule_reward", rule)
        judge = self.rewards.judge_score(out.responses(), list(rows)) if rows is not None else None
        if judge is not None:
            mb.set_samples("judge_score", judge)
        return mb

    def generate_conversations(self, prompts: Sequence[np.ndarray], *, index: Sequence[int], group: Sequence[int],
                               rows: Sequence[int], seeds: Sequence[int], keep: bool = True,
                               step: int | None = None) -> RolloutBatch | None:
        """generate_samples' multi-turn twin (algorithms/conversations.py): each prompt a
        conversation with the environment, run to its end; the batch also carries loss_mask,
        turn and role per token. Multi-turn replicas have one rank (RunConfig checks), so
        `keep` is always True here."""
        env = self.env
        assert env is not None, "collect() runs conversations only with an environment"
        convs = [mt.Conversation.start(env, self.renderer, self.rewards.rows[r], p, s)
                 for p, r, s in zip(prompts, rows, seeds)]
        mt.run_turns(convs, engine=self.engine, params=self.params, tokenizer=self.tokenizer, env=env,
                     renderer=self.renderer, settings=self.run.environment, max_seq_len=self.run.model.max_seq_len,
                     tracer=self.tracer, step=step)
        mb = mt.to_batch(convs, self.pad_id, index=index, group=group, rank=self.rank)
        mb.set_samples(VERSION, [self.version] * len(index))
        return mb if keep else None

    # -- a step's share ---------------------------------------------------------------------
    def collect(self, step: int, comm, layout, on_batch: Callable[[RolloutBatch], None] | None = None) -> Collected:
        """This rank's share of step `step`'s prompts (collective over `comm`, inside the
        generation layout `layout`): n_samples_per_prompt samples each (sample i * n + j of
        prompt slot i, group i: a group never splits), through the work-stealing prompt server
        (or static shards); each finished micro-batch goes to the critic at once, and to
        `on_batch` (the generator streams it to the actor)."""
        out = self._collect_round(step, comm, layout, 0, on_batch)
        if self.run.rl.dynamic_sampling_max_rounds:
            out = self._fill_with_varied_groups(step, comm, layout, out)
        return out

    def _collect_round(self, step: int, comm, layout, round: int,
                       on_batch: Callable[[RolloutBatch], None] | None = None) -> Collected:
        """One pass over num_rollout_samples prompt slots; round r's slots are numbered from
        r x num_rollout_samples, so that indices, groups and seeds stay unique within the step."""
        run = self.run
        k, n = run.rl.n_samples_per_prompt, run.ppo.num_rollout_samples
        order = prompt_order(run, len(self.prompts), step, round)
        out = Collected(pad_id=self.pad_id)
        generate = self.generate_samples if self.env is None else self.generate_conversations
        source = open_prompt_source(comm, layout, n, dynamic=run.switches.dynamic_prompts,
                                    tracer=self.tracer, step=step)
        for batch in replica_batches(layout, source, run.generation.prompt_batch_size):
            # Dataset positions may repeat when n > dataset; the step-local index keeps samples unique.
            idx = [(round * n + int(i)) * k + j for i in batch for j in range(k)]
            mb = generate([self.prompts[order[i // k - round * n]] for i in idx], index=idx,
                          group=[i // k for i in idx], rows=[int(order[i // k - round * n]) for i in idx],
                          seeds=[sample_seed(run.seed, step - 1, i) for i in idx],
                          keep=layout.is_requester, step=step)
            if mb is not None:
                out.pending.append((mb, self.to_critic(mb, step)))
                if on_batch is not None:
                    on_batch(mb)
        source.close()
        return out

    def _fill_with_varied_groups(self, step: int, comm, layout, out: Collected) -> Collected:
        """DAPO's dynamic sampling (collective over `comm`): more rounds of prompts until the step
        has num_rollout_samples groups whose rule rewards are not all equal, or
        rl.dynamic_sampling_max_rounds extra rounds were run; then the step keeps that many
        groups, the varied ones first (in slot order), equal ones filling what is short (the
        equal-reward filter drops those from training), renumbered as one round's would be."""
        run = self.run
        k, n = run.rl.n_samples_per_prompt, run.ppo.num_rollout_samples
        rounds = 1
        while True:
            mine = [(int(g), bool(v)) for mb, _ in out.pending for g, v in varied_groups(mb).items()]
            quiet.barrier(comm)
            groups = sorted(g for part in comm.allgather(mine) for g in part)
            varied = [g for g, v in groups if v]
            if len(varied) >= n or rounds > run.rl.dynamic_sampling_max_rounds:
                break
            out.pending += self._collect_round(step, comm, layout, rounds).pending
            rounds += 1
        chosen = varied[:n] + [g for g, v in groups if not v][:max(n - len(varied), 0)]
        new_id = {g: i for i, g in enumerate(sorted(chosen))}
        kept: list[tuple[RolloutBatch, Scores | None]] = []
        for mb, fut in out.pending:
            assert fut is None, "RunConfig: dynamic sampling runs without a critic"
            old = mb["group"].tolist()
            rows = [r for r, g in enumerate(old) if g in new_id]
            if rows:
                part = mb.select(rows)
                ids = [new_id[old[r]] for r in rows]
                part.set_samples("index", [g * k + int(i) % k for g, i in zip(ids, part["index"].tolist())])
                part.set_samples("group", ids)
                kept.append((part, None))
        n_varied = min(len(varied), n)
        n_equal = len(groups) - len(varied)
        out.pending = kept
        out.metrics = {"dynamic_sampling_rounds": float(rounds), "kept_varied_groups": float(n_varied),
                       "kept_equal_groups": float(len(chosen) - n_varied),
                       "dropped_equal_groups": float(n_equal - (len(chosen) - n_varied)),
                       "dropped_varied_groups": float(len(varied) - n_varied)}
        return out

    def to_critic(self, mb: RolloutBatch, step: int) -> Scores | None:
        """A finished micro-batch to the critic (values, reward-model score) and to the teacher
        (its log-probs of the sampled tokens, on-policy distillation): their futures, or None
        without either. Also for the samples a generator component streamed to the actor."""
        if self.critic is None and self.teacher is None:
            return None
        tokens, lengths = mb.tokens.numpy(), mb.seq_lengths.numpy()
        got = Scores(*(None if c is None else c.infer_async(tokens, lengths, step=step)
                       for c in (self.critic, self.teacher)))
        if not self.run.switches.async_critic:
            with self.tracer.span(P.CRITIC_WAIT, step):
                got.result()
        return got

    # -- evaluation -------------------------------------------------------------------------
    def greedy(self, prompts: Sequence[np.ndarray], max_new_tokens: int):
        """Greedy answers (no log-probs): evaluation's engine call."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_id=self.tokenizer.eos_id,
                                pad_id=self.pad_id, return_logprobs=False)
        return self.engine.generate([torch.from_numpy(p) for p in prompts], params, seeds=[0] * len(prompts))

    def greedy_conversations(self, prompts: Sequence[np.ndarray], rows: Sequence[dict]) -> list[mt.Conversation]:
        """Evaluation's multi-turn loop: greedy turns with the environment on held-out rows."""
        params = dataclasses.replace(self.params, temperature=0.0, return_logprobs=False)
        env = self.env
        assert env is not None, "multi-turn evaluation runs with an environment"
        convs = [mt.Conversation.start(env, self.renderer, row, p, 0) for p, row in zip(prompts, rows)]
        mt.run_turns(convs, engine=self.engine, params=params, tokenizer=self.tokenizer, env=env,
                     renderer=self.renderer, settings=self.run.environment, max_seq_len=self.run.model.max_seq_len)
        return convs

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
