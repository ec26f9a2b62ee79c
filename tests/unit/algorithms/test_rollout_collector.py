"""The rollout collector (algorithms/rollout_collector.py) against a recording engine and critic:
per-sample seeds (the same sample gets the same seed whatever rank, batch or prompt source draws
it), the step's prompt order, the order and labels of the samples it returns, rule rewards by
the real rule, and the dispatch of every finished micro-batch to the critic.

The engine and the critic here are FAKES that record what they are asked, in order, into one
shared log (the engines' sampling is tested in the generation tests, the critic's server in the
critic tests). Everything else is real: the prompt server and static shards over MPI.COMM_SELF,
the byte tokenizer, the prompt data set, the rule reward, the tracer.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from slurm_align.algorithms.policy_gradient import Rewards
from slurm_align.algorithms.rollout_collector import VERSION, RolloutCollector, prompt_order
from slurm_align.config import RunConfig
from slurm_align.data.datasets import PromptDataset
from slurm_align.generation.params import GenerationOutput, SamplingParams
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.parallel.layout import GenerationLayout
from slurm_align.profiling import phases as P
from slurm_align.profiling.timers import Tracer
from slurm_align.rewards.sort import target
from slurm_align.store.traces import read_traces
from tests.support.single_rank import mpi

PROMPTS = ["41672=", "1068=", "038854=", "9213=", "5570="]
"""The sort task's prompts (examples/synthetic); none is its own sorted answer reversed."""
K = 2   # samples per prompt


# -- the recording stand-ins -------------------------------------------------------------------------
@dataclass
class Call:
    prompts: list[list[int]]
    seeds: list[int] | None
    params: SamplingParams


class RecordingEngine:
    """Fake generation engine: records each generate() call (prompts, seeds, params) into the
    shared log. Its answer is decided by the sample's seed, so an answer can be traced back
    to its seed: an even seed answers right (the prompt's digits sorted, then EOS), an odd seed
    gives the digits unsorted and no EOS (cut: is_end false). Per-token log-probs encode the
    seed and the position."""

    def __init__(self, tokenizer: Any, log: list):
        self.tok, self.log, self.calls = tokenizer, log, []

    @staticmethod
    def answer(prompt_text: str, seed: int) -> tuple[str, bool]:
        digits = "".join(c for c in prompt_text if c.isdigit())
        return (target(prompt_text), True) if seed % 2 == 0 else (digits, False)

    @staticmethod
    def logprob(seed: int, position: int) -> float:
        return -0.01 * (seed % 50) - 0.1 * (position + 1)

    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds=None) -> GenerationOutput:
        self.log.append("generate")
        self.calls.append(Call([p.tolist() for p in prompts], None if seeds is None else list(seeds), params))
        # Without seeds an engine numbers the samples of the call (SamplingParams.seed + i).
        seeds = list(seeds) if seeds is not None else [params.seed + i for i in range(len(prompts))]
        rows = []
        for p, s in zip(prompts, seeds, strict=True):
            text, ended = self.answer(self.tok.decode(p.tolist()), s)
            rows.append((self.tok.encode(text) + ([params.eos_id] if ended else []), ended))
        width = max(len(r) for r, _ in rows)
        tokens = torch.full((len(rows), width), params.pad_id, dtype=torch.int64)
        logprobs = torch.zeros(len(rows), width)
        for i, ((r, _), s) in enumerate(zip(rows, seeds, strict=True)):
            tokens[i, :len(r)] = torch.tensor(r)
            logprobs[i, :len(r)] = torch.tensor([self.logprob(s, j) for j in range(len(r))])
        return GenerationOutput(tokens, torch.tensor([len(r) for r, _ in rows]),
                                torch.tensor([e for _, e in rows]), logprobs if params.return_logprobs else None)


class RecordingFuture(Future):
    """A finished critic reply that logs when someone waits for it."""

    def __init__(self, log: list, name: str, value: Any):
        super().__init__()
        self.log, self.name = log, name
        self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        self.log.append(f"wait {self.name}")
        return super().result(timeout)


@dataclass
class RecordingCritic:
    """Fake critic client: records each infer_async request (tokens, lengths, step)."""

    log: list
    requests: list[dict] = field(default_factory=list)

    def infer_async(self, tokens: np.ndarray, lengths: np.ndarray, *, step: int | None = None) -> Future:
        n = len(self.requests)
        self.requests.append({"tokens": tokens.copy(), "lengths": lengths.copy(), "step": step})
        self.log.append(f"infer {n}")
        values, scores = np.zeros(tokens.shape, np.float32), np.zeros(len(tokens), np.float32)
        return RecordingFuture(self.log, str(n), (values, scores))


# -- set-up ------------------------------------------------------------------------------------------
def layout(dp_rank: int = 0, dp_size: int = 1) -> GenerationLayout:
    """Generation DP rank dp_rank of dp_size, a replica of one rank (this process)."""
    comm = mpi().COMM_SELF
    return GenerationLayout(refold=True, dp_rank=dp_rank, dp_size=dp_size, tp_rank=0, tp_size=1, pp_rank=0,
                            pp_size=1, dp_group=None, tp_group=None, dp_comm=comm, mp_comm=comm, is_requester=True)


def make_run(**over: Any) -> RunConfig:
    cfg: dict[str, Any] = {
        "algorithm": "grpo", "seed": 7,
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 32},
        "rl": {"n_samples_per_prompt": K}, "reward": {"rule": "slurm_align.rewards.sort:exact"},
        "ppo": {"num_rollout_samples": len(PROMPTS)}, "generation": {"max_new_tokens": 8, "prompt_batch_size": 2},
    }
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return RunConfig(**cfg)


@dataclass
class Setup:
    run: RunConfig
    collector: RolloutCollector
    engine: RecordingEngine
    critic: RecordingCritic | None
    tracer: Tracer
    prompts: list[np.ndarray]
    log: list


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def setup(run: RunConfig, data: Path, *, critic: bool = True, rank: int = 0, trace_dir: Path | None = None) -> Setup:
    """A collector over the prompts file `data`; its spans go to trace_dir/traces.zarr (None: off)."""
    tok = build_tokenizer(run.model)
    dataset = PromptDataset(data, tok, run.model.max_seq_len)
    log: list = []
    engine = RecordingEngine(tok, log)
    rc = RecordingCritic(log) if critic else None
    tracer = Tracer(trace_dir, "actor", rank)
    collector = RolloutCollector(run, engine, tok, dataset.token_arrays(), Rewards(run, tok, dataset.fields()),
                                 rank=rank, tracer=tracer, critic=rc)
    return Setup(run, collector, engine, rc, tracer, dataset.token_arrays(), log)


def seeds_by_index(s: Setup, batch) -> dict[int, tuple[int, list[int]]]:
    """Sample index -> (the seed and the prompt the engine got for it), from the engine's record
    (its calls are in the order of the batch's rows)."""
    assert all(c.seeds is not None for c in s.engine.calls), "the engine was called without per-sample seeds"
    asked = [(seed, prompt) for c in s.engine.calls for seed, prompt in zip(c.seeds, c.prompts, strict=True)]
    return {int(i): a for i, a in zip(batch["index"].tolist(), asked, strict=True)}


# -- seeds and prompt order -----------------------------------------------------------------------------
# (dynamic prompt server or static shards, generation DP size, prompt_batch_size)
DRAWS = [(True, 1, 2), (True, 1, 5), (False, 2, 1), (False, 3, 2)]


def test_each_sample_gets_the_same_seed_whoever_draws_it(data: Path) -> None:
    """The seed (and the prompt) of sample i of step s depend on (run seed, s, i) only: not on
    the prompt source, the number of generating ranks, the rank, or the engine call's batch."""
    seen = {}
    for dynamic, dp, pbs in DRAWS:
        run = make_run(switches={"dynamic_prompts": dynamic}, generation={"prompt_batch_size": pbs})
        got: dict[int, tuple[int, list[int]]] = {}
        for r in range(dp):   # each generation DP rank's share, one after the other
            s = setup(run, data, critic=False)
            got.update(seeds_by_index(s, s.collector.collect(3, mpi().COMM_SELF, layout(r, dp)).batch))
        assert sorted(got) == list(range(len(PROMPTS) * K)), (dynamic, dp, pbs)
        seen[dynamic, dp, pbs] = got
    first = seen[DRAWS[0]]
    for draw in DRAWS[1:]:
        assert seen[draw] == first, f"seeds or prompts differ between draws {DRAWS[0]} and {draw}"
    seeds = [seed for seed, _ in first.values()]
    assert len(set(seeds)) == len(seeds), "two samples of the step share a seed"
    for i, (_, prompt) in first.items():   # a group's samples answer one prompt
        assert prompt == first[i - i % K][1]


def test_seeds_and_prompt_order_change_with_the_step_and_the_run_seed(data: Path) -> None:
    def draw(run: RunConfig, step: int) -> dict[int, tuple[int, list[int]]]:
        s = setup(run, data, critic=False)
        return seeds_by_index(s, s.collector.collect(step, mpi().COMM_SELF, layout()).batch)

    run = make_run()
    step2, step3, other = draw(run, 2), draw(run, 3), draw(make_run(seed=8), 2)
    for a, b in ((step2, step3), (step2, other)):
        assert not {seed for seed, _ in a.values()} & {seed for seed, _ in b.values()}
        assert [p for _, p in a.values()] != [p for _, p in b.values()]   # another shuffle
    # num_rollout_samples = the data set's size: each prompt once per step, K samples each
    every_prompt = sorted(tuple(p) for p in setup(run, data).prompts for _ in range(K))
    for got in (step2, step3):
        assert sorted(tuple(p) for _, p in got.values()) == every_prompt


def test_a_step_wanting_more_prompts_than_the_data_set_draws_with_replacement(data: Path) -> None:
    run = make_run(ppo={"num_rollout_samples": 8})
    s = setup(run, data, critic=False)
    batch = s.collector.collect(1, mpi().COMM_SELF, layout()).batch
    assert batch["index"].tolist() == list(range(8 * K))   # unique although prompts repeat
    order = prompt_order(run, len(PROMPTS), 1)
    assert len(set(order.tolist())) < 8
    assert [row.tolist() for row in batch.tokens[:, :6]] == [s.prompts[order[i // K]][:6].tolist()
                                                             for i in range(8 * K)]


# -- what comes back --------------------------------------------------------------------------------
def test_samples_come_back_in_generation_order_with_their_labels(data: Path) -> None:
    s = setup(make_run(), data, rank=3)
    s.collector.set_version(4)
    got = s.collector.collect(2, mpi().COMM_SELF, layout())
    batch = got.batch
    n = len(PROMPTS) * K
    assert batch["index"].tolist() == list(range(n))           # one rank: the slots in order
    assert batch["group"].tolist() == [i // K for i in range(n)]
    assert batch["rank"].tolist() == [3] * n and batch[VERSION].tolist() == [4] * n
    assert [len(c.prompts) for c in s.engine.calls] == [K * 2] * 2 + [K]   # prompt_batch_size 2
    asked = [(p, seed) for c in s.engine.calls for p, seed in zip(c.prompts, c.seeds, strict=True)]
    assert len(asked) == n
    order = prompt_order(s.run, len(PROMPTS), 2)
    for row, (prompt, seed) in enumerate(asked):
        assert prompt == s.prompts[order[row // K]].tolist()
        plen, rlen = int(batch.prompt_lengths[row]), int(batch.response_lengths[row])
        assert batch.tokens[row, :plen].tolist() == prompt
        text, ended = RecordingEngine.answer(s.collector.tokenizer.decode(prompt), seed)
        want = s.collector.tokenizer.encode(text) + ([s.collector.tokenizer.eos_id] if ended else [])
        assert batch.tokens[row, plen:plen + rlen].tolist() == want     # its own response
        assert bool(batch["is_end"][row]) == ended
        lp = batch["rollout_logprobs"][row]
        assert lp[:rlen].tolist() == pytest.approx([RecordingEngine.logprob(seed, j) for j in range(rlen)])
        assert not lp[rlen:].any()


def test_rule_rewards_score_each_response_against_its_own_prompt_row(data: Path) -> None:
    s = setup(make_run(), data)
    batch = s.collector.collect(2, mpi().COMM_SELF, layout()).batch
    seeds = [seed for c in s.engine.calls for seed in c.seeds]
    right = [float(seed % 2 == 0) for seed in seeds]   # the fake answered right for even seeds
    assert 0 < sum(right) < len(right)
    assert batch["rule_reward"].tolist() == right
    # Without a rule (a reward model scores) there is no rule reward column.
    s = setup(make_run(reward={"rule": None, "model": True}), data)
    assert "rule_reward" not in s.collector.collect(2, mpi().COMM_SELF, layout()).batch.samples


def test_a_replica_follower_runs_the_engine_call_and_keeps_nothing(data: Path) -> None:
    """generate_samples, the small interface: a follower rank of a generation replica (keep
    false) joins the engine call in lock-step (a TP engine needs every rank) and returns None;
    rows=None labels samples without a rule reward."""
    s = setup(make_run(), data)
    prompts = s.prompts[:2]
    assert s.collector.generate_samples(prompts, index=[0, 1], group=[0, 0], rows=[0, 1], seeds=[4, 5],
                                        keep=False) is None
    mb = s.collector.generate_samples(prompts, index=[0, 1], group=[0, 0], rows=None, seeds=[4, 5])
    assert [c.seeds for c in s.engine.calls] == [[4, 5], [4, 5]]
    assert mb is not None and mb["index"].tolist() == [0, 1] and "rule_reward" not in mb.samples


# -- the critic --------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_critic", [True, False])
def test_each_micro_batch_goes_to_the_critic_once_as_soon_as_it_is_generated(data: Path, tmp_path: Path,
                                                                          async_critic: bool) -> None:
    s = setup(make_run(switches={"async_critic": async_critic}), data, trace_dir=tmp_path)
    streamed = []
    got = s.collector.collect(2, mpi().COMM_SELF, layout(), on_batch=lambda mb: streamed.append(mb))
    calls = len(s.engine.calls)
    assert calls == 3 and len(got.pending) == calls
    # Sync critic: wait for each reply before generating on; async: the actor waits later.
    per_call = ["generate", "infer {}"] + ([] if async_critic else ["wait {}"])
    assert s.log == [e.format(i) for i in range(calls) for e in per_call]
    assert [mb for mb, _ in got.pending] == streamed
    for i, ((mb, fut), req) in enumerate(zip(got.pending, s.critic.requests, strict=True)):
        assert fut.critic.name == str(i) and fut.teacher is None   # paired with its own request's reply
        np.testing.assert_array_equal(req["tokens"], mb.tokens.numpy())
        np.testing.assert_array_equal(req["lengths"], mb.seq_lengths.numpy())
        assert req["step"] == 2
    s.tracer.step_done(2)
    phases = read_traces(tmp_path / "traces.zarr").spans["phase"].tolist()
    assert phases.count(P.GENERATE) == calls
    assert phases.count(P.CRITIC_WAIT) == (0 if async_critic else calls)


def test_without_a_critic_nothing_is_dispatched(data: Path) -> None:
    s = setup(make_run(), data, critic=False)
    got = s.collector.collect(2, mpi().COMM_SELF, layout())
    assert [fut for _, fut in got.pending] == [None] * len(s.engine.calls)


# -- evaluation ------------------------------------------------------------------------------------
def test_greedy_answers_sample_nothing(data: Path) -> None:
    s = setup(make_run(generation={"temperature": 0.7}), data)
    s.collector.greedy(s.prompts[:3], max_new_tokens=5)
    (call,) = s.engine.calls
    assert call.params.temperature == 0.0 and call.params.max_new_tokens == 5
    assert not call.params.return_logprobs and call.seeds == [0, 0, 0]
