"""DAPO's dynamic sampling in a real GRPO run (local profile, two actor ranks, the session's
SFT policy, whose groups sometimes all tie and sometimes not): every stored step is whole and
labelled as one round's, every trained group's rewards differ unless the cap was hit, and the
rounds are in the metrics."""

from __future__ import annotations

from pathlib import Path

from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_grpo import check_rollouts, grpo_config, launch, metrics


def test_dynamic_sampling_fills_steps_with_varied_groups(tmp_path: Path, sft_checkpoint: Path):
    launch(tmp_path, grpo_config("rl.filter_equal_reward_groups=true", "rl.dynamic_sampling_max_rounds=4",
                                 "eval.interval=0", f"model.init_checkpoint={sft_checkpoint}"))
    run_dir = tmp_path / "run"
    check_rollouts(run_dir, steps=[1, 2], samples=32, group=4)   # 8 groups of 4, the rule's rewards
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    for m in metrics(run_dir):
        rewards = store.read(m["step"])["reward"].reshape(8, 4)
        tied = int((rewards.min(1) == rewards.max(1)).sum())
        assert m["train_rollouts/dropped_groups"] == tied == m["train_rollouts/kept_equal_groups"], m
        assert m["train_rollouts/kept_varied_groups"] == 8 - tied
        assert m["train_rollouts/dynamic_sampling_rounds"] >= 1
        if m["train_rollouts/dynamic_sampling_rounds"] < 5:   # not capped: the step is full of varied groups
            assert tied == 0, m
    assert any(m["train_rollouts/dropped_equal_groups"] > 0 for m in metrics(run_dir)), "some groups tied"
