"""The algorithm registry (config/algorithms.py): adding an algorithm is one registration (a toy
one from a plugin module runs 2 real steps), and the sweep scales each algorithm's own batch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import ConfigError, RunConfig, load_profile, load_run_config
from slurm_align.config.algorithms import REGISTRY, AlgorithmSpec, algorithm_spec, register
from slurm_align.slurm.sweep import plan_sweep


def test_unregistered_algorithms_and_bad_specs_are_refused():
    with pytest.raises(ConfigError, match="algorithm 'toy_nope' is not registered; allowed: ppo, sft"):
        load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", ["algorithm=toy_nope"])
    with pytest.raises(ConfigError, match=r"field 'plugins'.*no_such_plugin"):
        load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", ["plugins=[no_such_plugin]"])
    with pytest.raises(ValueError, match="already registered"):
        register(AlgorithmSpec("grpo", rollout=True, estimator="rloo", loss="policy"))
    with pytest.raises(ValueError, match="trainer"):
        register(AlgorithmSpec("toy_trainer", rollout=False))
    assert "toy_trainer" not in REGISTRY
    assert algorithm_spec("ppo").value_model and not algorithm_spec("grpo").value_model


def _valid_config(spec: AlgorithmSpec) -> RunConfig:
    extra = {"rl": {"n_samples_per_prompt": max(spec.min_group_size, 1)},
             "reward": {"rule": "slurm_align.rewards.sort:exact"}} if spec.rollout and not spec.value_model else {}
    return RunConfig(algorithm=spec.name, ppo={"num_rollout_samples": 8}, trainer={"global_batch_size": 8}, **extra)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_sweep_scales_each_algorithms_batch_field(name):
    spec = REGISTRY[name]
    run = _valid_config(spec)
    profile = load_profile("local-slurm")
    points = plan_sweep(run, profile, [1, 2], "weak")
    section, field = spec.sweep_batch.split(".")
    assert [getattr(getattr(p.run, section), field) for p in points] == [8, 16]
    other = "trainer.global_batch_size" if spec.sweep_batch == "ppo.num_rollout_samples" else "ppo.num_rollout_samples"
    o_section, o_field = other.split(".")
    assert [getattr(getattr(p.run, o_section), o_field) for p in points] == [8, 8]   # the other batch stays
    assert [p.critic_nodes > 0 for p in points] == [spec.value_model] * 2


@pytest.mark.mpi
@pytest.mark.slow
def test_a_toy_algorithm_registered_by_a_plugin_runs_two_steps(tmp_path):
    """One registration (tests/support/toy_algorithm.py) and the whole loop runs it: config validation,
    the job's shape, rendering, 2 actor ranks (DP=2), its estimator, the policy loss, the store."""
    from slurm_align.slurm.launch import launch_run
    from slurm_align.store.rollouts import RolloutStore

    synth = REPO_ROOT / "examples" / "synthetic"
    run = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
        "plugins=[tests.support.toy_algorithm]", "algorithm=toy_batch_mean", "rl.n_samples_per_prompt=1",
        "reward.rule=tests.support.toy_algorithm:length_reward", f"data.train_path={synth / 'prompts.jsonl'}",
        "eval.interval=0", "ppo.num_steps=2", "ppo.num_rollout_samples=16", "ppo.global_batch_size=16",
        "ppo.train_micro_batch_size=8", "generation.max_new_tokens=8", "generation.prompt_batch_size=2"])
    assert run.components == ("actor",) and run.advantage_estimator == "toy_batch_mean"
    local = load_profile("local")   # jobs run in their run directory: make tests/ importable there
    profile = local.model_copy(update={"env": {**local.env, "PYTHONPATH": str(REPO_ROOT)}})
    job = launch_run(run, profile, tmp_path / "run")
    state = job.wait(timeout_s=900)
    if state != "COMPLETED":
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for ps in job.failed_logs().values() for p in ps)
        pytest.fail(f"run ended {state}\n{logs}")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train_optim/optimizer_steps"] == 1 for r in rows)
    store = RolloutStore.open(tmp_path / "run" / "rollouts.zarr", read_only=True)
    for step in (1, 2):
        d = store.read(step)
        ro, reward = d["response_offsets"], d["reward"]
        assert len(reward) == 16 and np.ptp(reward) > 0        # the rule's graded rewards
        # the toy estimator's advantage: reward minus the step's mean reward, on every token
        expect = np.repeat(reward - reward.mean(), np.diff(ro))
        assert np.abs(d["advantages"] - expect).max() < 1e-5
