"""The RL actor's policy loss is a registered loss (losses/registry.py, kind 'policy'): GSPO's
sequence-level ratio from a plugin module (tests/support/gspo_loss.py) with its own option is
the actor's update on a real one-rank policy in this process, and
bad choices are config errors naming loss.name / loss.options."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align.algorithms.policy_gradient import PolicyUpdate
from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.algorithms.rollout_losses import PolicyLoss
from slurm_align.config import ConfigError
from slurm_align.models.forward import forward_logprobs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.lora import trainable_parameters
from slurm_align.models.optimizer import build_optimizer
from slurm_align.models.packing import run_batching
from slurm_align.models.worker import ModelWorker
from slurm_align.profiling.timers import Tracer
from tests.support import gspo_loss
from tests.unit.algorithms.test_ppo_step import make_run, world  # noqa: F401  (world: a fixture)


def test_gspo_from_a_plugin_is_the_actors_update(tmp_path: Path, world) -> None:  # noqa: F811
    """PolicyUpdate (the RL actor's update, through the model worker's step) trains with the
    run's registered policy loss (algorithms/rollout_losses.PolicyLoss around it): the
    plugin's GSPO, with its option, on a real one-rank policy; the first call sees ratio 1
    (pi == pi_old: the batch's log-probs are the policy's own) and the weights move."""
    _, pctx = world
    run = make_run(tmp_path, "grpo", loss={"name": "toy_gspo", "options": {"eps_high": 5e-4}})
    policy = build_gpt(run.model, pctx, seed=run.seed)
    optimizer = build_optimizer(trainable_parameters(policy), pctx, run.training, lr=1e-3)
    worker = ModelWorker.around(policy, optimizer, pctx, run.model,
                                batching=run_batching(run, "actor", run.ppo.train_micro_batch_size))
    update = PolicyUpdate(run, worker)
    assert isinstance(update.objective, PolicyLoss)
    assert update.objective.fn is gspo_loss.gspo_loss and update.objective.options.eps_high == 5e-4

    g = np.random.default_rng(0)
    batch = RolloutBatch.from_sequences([g.integers(1, 250, 4) for _ in range(4)],
                                        [g.integers(1, 250, n) for n in (3, 5, 2, 4)], pad_id=0,
                                        index=np.arange(4), group=np.array([0, 0, 1, 1]),
                                        reward=np.zeros(4, np.float32), is_end=np.ones(4, dtype=bool))
    own = forward_logprobs(policy, pctx, batch.tokens, run.model.vocab_size, lengths=batch.seq_lengths)
    batch.set_tokens("logprobs", batch.from_positions(own))
    batch.set_tokens("ref_logprobs", batch.from_positions(own))
    batch.set_tokens("advantages", torch.from_numpy(g.normal(size=batch.mask.shape)) * batch.mask)
    batch.set_samples("train", np.ones(4, np.float32))
    before = [p.detach().clone() for p in trainable_parameters(policy)]
    gspo_loss.CALLS.clear()
    metrics = update.train(batch, 1, Tracer(None, "actor", 0))
    assert gspo_loss.CALLS and gspo_loss.CALLS[0] == pytest.approx(1.0, abs=1e-5), gspo_loss.CALLS
    assert metrics["optimizer_steps"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainable_parameters(policy)))


@pytest.mark.parametrize("over, needle", [
    ({"name": "preference"}, "field 'loss.name': got 'preference', a trainer loss; grpo takes a policy loss: ppo_clip"),
    ({"name": "toy_gspo", "options": {"eps_low": 2}}, "field 'loss.options.eps_low': got 2"),
    ({"options": {"beta": 0.1}}, "field 'loss.options.beta': got 0.1; unknown key of loss 'ppo_clip'"),
])
def test_bad_policy_losses_are_config_errors(tmp_path: Path, over: dict, needle: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as e:
        make_run(tmp_path, "grpo", loss=over)
    assert needle in str(e.value), str(e.value)
