"""PPOActor.step's phase order (algorithms/ppo.py; ../shared/DESIGN.md "Data flow of one PPO
step"), read from the spans the step records and from the calls that reach the engine and the
critic:

    refit -> generate (each micro-batch to the critic at once) -> rebalance -> logprobs ->
    init_logprobs -> critic_wait -> rebalance (values and rewards follow, advantages) -> store ->
    train (the critic's update sent just before) -> critic_wait (its loss)

The actor is the one a job builds (build_actor: a real megatron GPT, optimizer, reference,
tokenizer, data set, rule reward, tracer, rollout store) in a world of one rank in this process
(MPI.COMM_SELF, gloo). At the engine/critic boundary: the real torch engine wrapped so that its
calls are logged, and a FAKE critic client that logs its requests and answers at once (the
critic's server is tested in the critic tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.algorithms import ppo
from slurm_align.config import RunConfig
from slurm_align.parallel.bootstrap import DistEnv
from slurm_align.parallel.layout import ParallelContext
from slurm_align.profiling import phases as P
from slurm_align.rundir import RunDir
from slurm_align.store.rollouts import RolloutStore
from slurm_align.store.traces import read_traces
from tests.support.single_rank import single_rank_world


class Events:
    """Calls at the engine/critic boundary, timed on the actor's tracer clock (so that they can
    be placed among its spans)."""

    def __init__(self) -> None:
        self.clock: Callable[[], int] | None = None
        self.items: list[tuple[int, str]] = []

    def add(self, name: str) -> None:
        assert self.clock is not None
        self.items.append((self.clock(), name))


class RecordingEngine:
    """The real engine; refit and generate calls are logged on their way through."""

    def __init__(self, engine: Any, events: Events):
        self._engine, self._events = engine, events
        self.shape = engine.shape

    def refit(self, full_state_dict: dict) -> float:
        self._events.add("engine.refit")
        return self._engine.refit(full_state_dict)

    def generate(self, prompts: list, params: Any, seeds: Any = None) -> Any:
        self._events.add("engine.generate")
        return self._engine.generate(prompts, params, seeds)

    def __getattr__(self, name: str) -> Any:   # free(), sleep(), device, ...
        return getattr(self._engine, name)


class LoggedFuture(Future):
    def __init__(self, events: Events, name: str, value: Any):
        super().__init__()
        self.events, self.name = events, name
        self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        self.events.add(f"{self.name} result")
        return super().result(timeout)


class FakeCritic:
    """Stand-in for CriticClient: values 0.1 at every position and a reward-model score of 0.5
    per sample, an update that reports loss 1.0; every request and every wait is logged."""

    def __init__(self, events: Events):
        self.events = events

    def infer_async(self, tokens: np.ndarray, lengths: np.ndarray, *, step: int | None = None) -> Future:
        self.events.add("critic.infer")
        values = np.full(tokens.shape, 0.1, np.float32)
        return LoggedFuture(self.events, "critic.infer", (values, np.full(len(tokens), 0.5, np.float32)))

    def train_async(self, tokens, lengths, returns, prev_values, mask, *, step: int | None = None) -> Future:
        self.events.add("critic.train")
        return LoggedFuture(self.events, "critic.train", 1.0)

    def connect(self) -> None:
        pass

    def shutdown_critic(self) -> None:
        pass

    def close(self) -> None:
        pass


MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 32}
ENGINE_CALLS = 2   # num_rollout_samples / prompt_batch_size


def make_run(tmp_path: Path, algorithm: str, **over: Any) -> RunConfig:
    cfg: dict[str, Any] = {
        "algorithm": algorithm, "seed": 3, "model": MODEL, "critic_model": MODEL,
        "actor": {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1},
        "data": {"train_path": str(REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl")},
        "generation": {"max_new_tokens": 6, "prompt_batch_size": 2},
        "ppo": {"num_steps": 2, "num_rollout_samples": 4, "train_micro_batch_size": 4},
        "reward": {"rule": "slurm_align.rewards.sort:partial", "model": algorithm == "ppo"},
        "rl": {"n_samples_per_prompt": 2 if algorithm == "grpo" else 1},
    }
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return RunConfig(**cfg)


@pytest.fixture
def world() -> Iterator[tuple[DistEnv, ParallelContext]]:
    with single_rank_world() as w:
        yield w


def run_one_step(run: RunConfig, rd: RunDir, world: tuple[DistEnv, ParallelContext],
                 monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict]:
    """Build the actor as a job does (engine and critic client at the boundary recorded), run
    step 1; returns the step's timeline (its spans by start, the boundary calls among them) and
    its metrics."""
    env, pctx = world
    events = Events()
    real_engine = ppo.actor_engine
    monkeypatch.setattr(ppo, "actor_engine", lambda *a: RecordingEngine(real_engine(*a), events))
    monkeypatch.setattr(ppo.CriticClient, "from_run_config", classmethod(lambda cls, run: FakeCritic(events)))
    actor = ppo.build_actor(run, rd, env, pctx)
    events.clock = actor.tracer.now_ns
    try:
        metrics = actor.step(1)
        actor.tracer.step_done(1)
    finally:
        actor.close()
    spans = read_traces(rd.root / "traces.zarr").spans
    # The prompt server's waits for prompt batches are its own business (tests of balance/).
    spans = spans[spans["phase"] != P.PROMPT_WAIT]
    assert (spans["step"] == 1).all()
    # One phase at a time: none starts before the previous one ended.
    assert (spans["start_ns"][1:] >= spans["end_ns"][:-1]).all(), list(spans["phase"])
    timeline = sorted([(int(s["start_ns"]), str(s["phase"])) for s in spans] + events.items)
    return [name for _, name in timeline], metrics


def generation(critic: bool) -> list[str]:
    return [P.REFIT, "engine.refit"] + [P.GENERATE, "engine.generate"] * ENGINE_CALLS if not critic else \
        [P.REFIT, "engine.refit"] + [P.GENERATE, "engine.generate", "critic.infer"] * ENGINE_CALLS


def test_a_ppo_step_runs_its_phases_in_order(tmp_path: Path, world, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, "ppo")
    assert run.uses_reference and run.critic_trains
    timeline, metrics = run_one_step(run, RunDir(tmp_path), world, monkeypatch)
    assert timeline == generation(critic=True) + [
        P.REBALANCE, P.LOGPROBS, P.INIT_LOGPROBS,
        P.CRITIC_WAIT] + ["critic.infer result"] * ENGINE_CALLS + [
        P.REBALANCE, P.STORE, "critic.train", P.TRAIN, P.CRITIC_WAIT, "critic.train result"]
    assert metrics["train_optim/critic_loss"] == 1.0 and metrics["train_optim/optimizer_steps"] == 1
    # what went through the phases: the step's rollouts, stored with the critic's values
    store = RolloutStore.open(tmp_path / "rollouts.zarr", read_only=True)
    stored = store.read(1)
    assert len(stored["reward"]) == run.rollouts_per_step
    np.testing.assert_allclose(stored["values"], 0.1)


def test_a_grpo_step_without_reference_or_critic_skips_their_phases(tmp_path: Path, world,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, "grpo")
    assert not run.uses_reference and "critic" not in run.components
    timeline, metrics = run_one_step(run, RunDir(tmp_path), world, monkeypatch)
    assert timeline == [*generation(critic=False),
                        P.REBALANCE, P.LOGPROBS, P.CRITIC_WAIT, P.REBALANCE, P.STORE, P.TRAIN]
    assert "train_optim/critic_loss" not in metrics


def test_in_critic_warm_up_only_the_critic_trains(tmp_path: Path, world, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path, "ppo", ppo={"critic_warmup_steps": 1})
    timeline, metrics = run_one_step(run, RunDir(tmp_path), world, monkeypatch)
    assert timeline[-4:] == [P.STORE, "critic.train", P.CRITIC_WAIT, "critic.train result"]
    assert P.TRAIN not in timeline and "train_optim/optimizer_steps" not in metrics
