"""Advantage estimators, KL estimators and loss aggregation against values computed by hand."""

import math

import pytest
import torch

from slurm_align.algorithms.advantages import equal_reward_groups, grpo, per_token, reinforce_pp, rloo
from slurm_align.algorithms.policy_loss import LossTerms, aggregate, clipped_policy_loss, denominator, kl_penalty
from slurm_align.algorithms.rejection_sampling import best_of_groups

# Three groups: [1, 0, 0] (id 7), [2, 2] (all equal, id 3), [5] (a group of one, id 9).
SCORES = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([7, 7, 7, 3, 3, 9])


def test_grpo_by_hand():
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)   # Bessel: n - 1 = 2
    adv = grpo(SCORES, GROUPS)
    expected = [(1 - mean) / (std + 1e-6), -mean / (std + 1e-6), -mean / (std + 1e-6), 0.0, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert torch.isfinite(adv).all()


def test_dr_grpo_has_no_std_division():
    adv = grpo(SCORES, GROUPS, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]), atol=1e-6)


def test_rloo_by_hand():
    # leave-one-out: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5 (twice); equal group 0; single 0
    adv = rloo(SCORES, GROUPS)
    assert torch.allclose(adv, torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]), atol=1e-6)


def test_rloo_is_grpo_without_std_scaled_by_n_over_n_minus_1():
    s = torch.tensor([0.3, 0.9, 0.1, 0.7])
    g = torch.zeros(4, dtype=torch.long)
    assert torch.allclose(rloo(s, g), grpo(s, g, normalize_std=False) * 4 / 3, atol=1e-6)


def test_all_equal_and_single_groups_give_zero_without_nan():
    for fn in (grpo, rloo, lambda s, g: grpo(s, g, normalize_std=False)):
        adv = fn(torch.tensor([3.0, 3.0, 3.0, 4.0]), torch.tensor([0, 0, 0, 1]))
        assert torch.equal(adv, torch.zeros(4))


def test_reinforce_pp_by_hand():
    scores = torch.tensor([1.0, 0.0])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    c = 0.1
    # per-token rewards -c * (logp - ref), score on the last real token
    r0 = [-c * 0.5, 0.0, -c * 0.5 + 1.0]
    r1 = [c * 0.5, 0.0 + 0.0]              # score 0 on its last real token
    g0 = [sum(r0), r0[1] + r0[2], r0[2]]
    g1 = [sum(r1), r1[1]]
    vals = g0 + g1
    mean = sum(vals) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 5)
    expected = torch.tensor([[(v - mean) / std for v in g0], [(v - mean) / std for v in g1] + [0.0]])
    adv, returns = reinforce_pp(scores, logp, ref, mask, c)
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(returns, torch.tensor([g0, [*g1, 0.0]]), atol=1e-6)   # G_t itself


def test_per_token_broadcasts_onto_the_mask():
    out = per_token(torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert torch.equal(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_equal_reward_groups_marks_constant_and_single_groups():
    drop = equal_reward_groups(SCORES, GROUPS)
    assert drop.tolist() == [False, False, False, True, True, True]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = [-0.5, 1.0]                                           # ref - logp
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    k3 = [math.exp(x) - x - 1 for x in d]
    assert torch.allclose(kl_penalty(logp, ref, "k3"), torch.tensor(k3))
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros(2))


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("agg,expected", [
    ("token-mean", (1 + 2 + 3 + 4) / 4),
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
    ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
])
def test_loss_aggregation_by_hand(agg, expected):
    assert math.isclose(float(aggregate(LOSS, MASK, agg)), expected, rel_tol=1e-6)


def test_aggregation_with_a_global_denominator_sums_to_the_global_mean():
    # two "ranks" each see one sequence; their shares with the global count add up to the whole
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        n = denominator(MASK, agg)
        parts = [aggregate(LOSS[i:i + 1], MASK[i:i + 1], agg, norm=n) for i in range(2)]
        assert math.isclose(float(sum(parts)), float(aggregate(LOSS, MASK, agg)), rel_tol=1e-6)


def test_asymmetric_clip_by_hand():
    # ratios e^0.4 ~ 1.49 (A > 0) and e^-0.4 ~ 0.67 (A < 0) on one token each
    logp = torch.tensor([[0.4, -0.4]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    terms = LossTerms(eps_low=0.2, eps_high=0.28)
    loss, st = clipped_policy_loss(logp, old, adv, mask, terms)
    # token 0: min(1.49, 1.28) = 1.28; token 1: min(-0.67, -0.8) = -0.8 -> loss = -(1.28 - 0.8) / 2
    assert math.isclose(float(loss), -(1.28 - 0.8) / 2, rel_tol=1e-6)
    assert st.clipped_fraction == 1.0
    assert math.isclose(st.ratio, (math.exp(0.4) + math.exp(-0.4)) / 2, rel_tol=1e-6)
    # the clipped side has no gradient; inside the clip range the gradient is A * ratio
    logp = torch.tensor([[0.1, -0.1]], requires_grad=True)
    loss, st = clipped_policy_loss(logp, old, adv, mask, terms)
    loss.backward()
    assert st.clipped_fraction == 0.0
    assert torch.allclose(logp.grad, torch.tensor([[-math.exp(0.1) / 2, math.exp(-0.1) / 2]]), atol=1e-6)


def test_kl_loss_term_is_added_with_its_coefficient():
    logp, old, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    zero_adv = torch.zeros(1, 2)
    loss, st = clipped_policy_loss(logp, old, zero_adv, mask, LossTerms(kl_loss_coef=0.5, kl_estimator="k2"),
                                   ref_logp=ref)
    assert math.isclose(float(loss), 0.5 * (0.125 + 0.5) / 2, rel_tol=1e-6)
    assert math.isclose(st.kl, (0.125 + 0.5) / 2, rel_tol=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        clipped_policy_loss(logp, old, zero_adv, mask, LossTerms(kl_loss_coef=0.5))


def test_rejection_sampling_keeps_the_best_of_each_decided_group():
    # groups: [1, 0, 0] keeps its 1; [2, 2] and [5] have no best (all equal) and keep nothing;
    # [0.2, 0.9, 0.9] keeps the first 0.9
    scores = torch.cat([SCORES, torch.tensor([0.2, 0.9, 0.9])])
    groups = torch.cat([GROUPS, torch.tensor([4, 4, 4])])
    assert best_of_groups(scores, groups).tolist() == [1, 0, 0, 0, 0, 0, 0, 1, 0]
