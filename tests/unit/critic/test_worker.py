"""The critic serves a regression (multi-attribute) reward model: its reward is the configured
weighted sum of the attributes at each sequence's last token, and the PPO value model built
beside it is scalar, with the reward model's trunk. In this process on a one-rank world."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align.config.run import ModelConfig, RunConfig
from slurm_align.critic.channel import Command
from slurm_align.critic.main import build_models
from slurm_align.critic.swap import REWARD, VALUE, ModelSwap
from slurm_align.critic.worker import CriticWorker
from slurm_align.models.checkpoint import save_checkpoint
from slurm_align.models.forward import forward_values, last_token_values
from slurm_align.models.gpt import build_gpt
from slurm_align.models.weights import full_state_dict
from tests.support.single_rank import single_rank_world

MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 100, "max_seq_len": 32}
WEIGHTS = [0.5, -2.0, 1.0]


def test_the_critic_scores_with_the_weighted_attributes_and_a_scalar_value_model(tmp_path: Path):
    with single_rank_world() as (env, pctx):
        rm_cfg = ModelConfig(**MODEL, num_labels=3)
        rm = build_gpt(rm_cfg, pctx, value_head=True, seed=3)
        ckpt = save_checkpoint(tmp_path / "rm", 1, rm, None, {"algorithm": "rm"})
        run = RunConfig(algorithm="ppo", model=MODEL, critic_model={**MODEL, "num_labels": 3, "init_checkpoint": ckpt},
                        reward={"attribute_weights": WEIGHTS})
        models = build_models(run, pctx)
        reward_sd, value_sd = (full_state_dict(models[k], pctx) for k in (REWARD, VALUE))
        assert reward_sd is not None and value_sd is not None
        assert tuple(value_sd["value_head.weight"].shape) == (1, 32)
        assert tuple(reward_sd["value_head.weight"].shape) == (3, 32)
        trunk = [k for k in reward_sd if not k.startswith("value_head.")]
        assert trunk and all(torch.equal(reward_sd[k], value_sd[k]) for k in trunk)

        worker = CriticWorker(ModelSwap(models, keep_resident=True), pctx, env.comm, lr=1e-3, value_clip=0.2,
                              checkpoint_dir=tmp_path / "c", reward_weights=WEIGHTS)
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 99, size=(4, 12)).astype(np.int64)
        lengths = np.array([12, 7, 9, 3], dtype=np.int64)
        values, rewards = worker.execute(Command("infer", {"tokens": tokens, "lengths": lengths}))
        attrs = last_token_values(forward_values(models[REWARD], pctx, torch.from_numpy(tokens), num_labels=3,
                                                 lengths=torch.from_numpy(lengths)), torch.from_numpy(lengths))
        expected = (attrs.double() @ torch.tensor(WEIGHTS, dtype=torch.float64)).numpy()
        assert values.shape == (4, 12) and rewards.shape == (4,)
        np.testing.assert_allclose(rewards, expected, rtol=1e-5, atol=1e-5)
        assert np.ptp(attrs.numpy(), axis=0).min() > 0   # the attributes differ across rows: the weights matter


def test_a_regression_reward_model_needs_one_weight_per_attribute():
    with pytest.raises(ValueError, match=r"field 'reward\.attribute_weights': got \[1\.0\].*num_labels=3"):
        RunConfig(algorithm="grpo", rl={"n_samples_per_prompt": 2}, critic_model={**MODEL, "num_labels": 3},
                  reward={"attribute_weights": [1.0]})
