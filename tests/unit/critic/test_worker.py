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


def _value_loop_as_before(worker: CriticWorker, tokens, lengths, returns, prev_values, mask) -> float:
    """The critic's value training before the model worker (246a4ba's CriticWorker._train),
    verbatim but for the names: its own micro-batches, loss and step."""
    from slurm_align.critic.loss import clipped_value_loss_sum
    from slurm_align.models.forward import per_sequence, run_schedule
    from slurm_align.models.packing import micro_batch_inputs
    chunks = worker.swap.use(VALUE)
    for c in chunks:
        c.train()
    total = float(mask.sum())
    tok, seq_len = torch.from_numpy(tokens), torch.from_numpy(lengths).long()
    per_pos = {"returns": torch.from_numpy(returns), "prev": torch.from_numpy(prev_values),
               "mask": torch.from_numpy(mask)}
    mbs = []
    for inp in micro_batch_inputs(tok, seq_len, worker.batching.groups(seq_len), pack=worker.batching.pack,
                                  fixed_shape=False):
        mb = {"tokens": inp["tokens"], **{k: v[inp["rows"]] for k, v in per_pos.items()}}
        mb["mask"] = mb["mask"] * inp["real"][:, None]
        if "packing" in inp:
            mb["packing"] = inp["packing"]
            width = int(inp["packing"].lengths.max())
            mb.update({k: mb[k][:, :width] for k in per_pos})
        mbs.append(mb)

    def loss_fn(values, mb):
        loss = clipped_value_loss_sum(per_sequence(values.float(), mb), mb["prev"], mb["returns"], mb["mask"],
                                      worker.value_clip) / total
        return loss, {"loss": loss.detach()}

    assert worker.optimizer is not None
    worker.optimizer.zero_grad()
    local = torch.zeros(1)
    for info in run_schedule(chunks, mbs, loss_fn, forward_only=False):
        local += info["loss"]
    worker.optimizer.step()
    return float(local)


@pytest.mark.parametrize("pack", [False, True])
def test_the_value_model_trains_through_the_model_worker_as_it_did_before(tmp_path: Path, pack: bool):
    """The critic's `train` command goes through the one model worker's step with the registered
    value loss (losses/value.py): on a fixed batch, with SGD at lr 1 (weights move by exactly the
    gradient) and micro-batches of 2 rows (padded, or token-budget packed), the value model's
    weights and the loss equal, bit for bit, those of the critic's own loop before the worker."""
    from slurm_align.models.packing import Batching
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 99, size=(5, 12)).astype(np.int64)
    lengths = np.array([12, 7, 9, 3, 10], dtype=np.int64)
    pos = np.arange(12)[None, :]
    mask = ((pos >= 2) & (pos < lengths[:, None])).astype(np.float32)   # prompt positions do not count
    returns = rng.normal(size=(5, 12)).astype(np.float32) * mask
    prev = rng.normal(size=(5, 12)).astype(np.float32) * 0.3 * mask
    batching = Batching(max_tokens=24, pack=True) if pack else Batching(micro_batch_size=2)
    results = []
    with single_rank_world() as (env, pctx):
        for way in ("before", "worker"):
            cfg = ModelConfig(**MODEL)
            models = {VALUE: build_gpt(cfg, pctx, value_head=True, seed=4),
                      REWARD: build_gpt(cfg, pctx, value_head=True, seed=5)}
            start = full_state_dict(models[VALUE], pctx)
            # the reward model resident: the value model must be swapped in to train
            worker = CriticWorker(ModelSwap(models, keep_resident=False, resident=REWARD), pctx, env.comm, lr=1.0,
                                  value_clip=0.2, checkpoint_dir=tmp_path / way, batching=batching, model_cfg=cfg)
            assert worker.optimizer is not None
            worker.optimizer.optimizer = torch.optim.SGD(worker.optimizer.params, lr=1.0)
            if way == "before":
                loss = _value_loop_as_before(worker, tokens, lengths, returns, prev, mask)
            else:
                loss = worker.execute(Command("train", {"tokens": tokens, "lengths": lengths, "returns": returns,
                                                        "prev_values": prev, "mask": mask}))
            results.append((start, full_state_dict(models[VALUE], pctx), loss))
    (start, want, want_loss), (_, got, got_loss) = results
    assert start is not None and want is not None and got is not None
    assert max(float((want[k] - start[k]).abs().max()) for k in start) > 1e-3   # the step moves the weights
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got_loss == pytest.approx(want_loss, rel=1e-6) and want_loss > 0
