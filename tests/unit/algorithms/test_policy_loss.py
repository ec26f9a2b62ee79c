"""PPO numerics on fixed inputs against values computed by hand from the formulas: the KL-penalised
rewards, GAE and whitening (algorithms/advantages.py), the clipped policy loss as the actor's update
builds it (algorithms/policy_loss.py) and the critic's value loss."""

import math

import torch

from slurm_align.algorithms.advantages import gae, kl_penalized_rewards, masked_whiten
from slurm_align.algorithms.policy_loss import LossTerms, clipped_policy_loss
from slurm_align.critic.loss import clipped_value_loss


def test_kl_rewards_place_score_on_last_token():
    score = torch.tensor([2.0, -1.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    r = kl_penalized_rewards(score, logp, ref, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.05, 0.0, 0.1 + 2.0], [-0.05, -0.05 - 1.0, 0.0]])
    assert torch.allclose(r, expected, atol=1e-6)


def test_gae_by_hand():
    # one sample of 3 tokens, one of 2 (then padding)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, -1.0, 9.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    g, lam = 1.0, 0.95
    # sample 0: deltas with next value 0 after the last token
    d2 = 1.0 + 0 - 0.3
    d1 = 0.0 + g * 0.3 - 0.2
    d0 = 0.0 + g * 0.2 - 0.1
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    # sample 1: the padded position must not leak its reward (9.0) or value (9.0)
    e1 = -1.0 + 0 - 0.5
    e0 = 0.5 + g * 0.5 - 0.4
    b1 = e1
    b0 = e0 + g * lam * b1
    adv, ret = gae(rewards, values, mask, gamma=g, lam=lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[a0 + 0.1, a1 + 0.2, a2 + 0.3], [b0 + 0.4, b1 + 0.5, 0.0]]), atol=1e-6)


def test_gae_discount():
    adv, _ = gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), gamma=0.5, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 1.0]]))


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    vals = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean = sum(vals) / 5
    var = sum((v - mean) ** 2 for v in vals) / 5
    w = masked_whiten(x, mask)
    expected = [[(1 - mean) / math.sqrt(var), (2 - mean) / math.sqrt(var), 0.0],
                [(3 - mean) / math.sqrt(var), (4 - mean) / math.sqrt(var), (5 - mean) / math.sqrt(var)]]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-5)


def test_policy_loss_by_hand():
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [0.0, 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [5.0, 5.0]])
    mask = torch.ones(2, 2)
    is_end = torch.tensor([True, False])   # the second response was cut: it does not count
    # The actor's update weighs each response by is_end (algorithms/rollout_losses.py RolloutNLL.counted).
    loss, stats = clipped_policy_loss(logp, old, adv, mask * is_end.float()[:, None], LossTerms(0.2, 0.2))
    # token 0: ratio 1.5 -> min(1.5, 1.2) * 1 = 1.2 ; token 1: ratio 0.5 -> min(0.5, 0.8) = 0.5
    assert math.isclose(float(loss), -(1.2 + 0.5) / 2, rel_tol=1e-6)
    assert math.isclose(stats.clipped_fraction, 0.5)   # only token 0 was clipped
    assert math.isclose(stats.ratio, 1.0)


def test_policy_loss_negative_advantage_clip():
    # A<0: min(r*A, clip(r)*A) picks the more negative -> clip active for r < 1 - eps
    loss, stats = clipped_policy_loss(torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1), torch.tensor([[-2.0]]),
                                      torch.ones(1, 1), LossTerms(0.2, 0.2))
    assert math.isclose(float(loss), 0.8 * 2.0, rel_tol=1e-6)
    assert stats.clipped_fraction == 1.0


def test_critic_loss_by_hand():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    ret = torch.tensor([[0.0, 1.0]])
    # token 0: clipped v = 0.7 -> 0.5*max(0.49, 1.0) = 0.5 ; token 1: 0.5*max(1, 1) = 0.5
    loss = clipped_value_loss(v, old, ret, torch.ones(1, 2), clip=0.2)
    assert math.isclose(float(loss), 0.5, rel_tol=1e-6)
