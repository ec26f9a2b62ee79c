"""The DPO family (losses/preference.py) on fixed inputs against a hand computation of issue 38's
formulas in plain Python floats (fp64, 1e-9): every preference_loss, cDPO label smoothing, summed
and averaged log-probs, default rewards and the SFT term."""

from __future__ import annotations

import math

import pytest
import torch

from slurm_align.config.run import ModelConfig
from slurm_align.losses.preference import Preference, preference_terms
from slurm_align.losses.registry import PreferenceOptions, loss_spec

# two pairs: sequence log-probs of policy and reference, chosen first, then rejected
POLICY = [-3.0, -7.5, -4.0, -6.0]
REFERENCE = [-3.5, -5.0, -4.2, -6.5]
REWARDS = [4.0, 1.5, 2.0, 3.0]   # chosen_reward, chosen_reward, rejected_reward, rejected_reward


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def hand(kind: str, beta: float, pair: int, eps: float = 0.0, scale: float = 1.0) -> float:
    pc, pr = POLICY[pair], POLICY[2 + pair]
    rc, rr = REFERENCE[pair], REFERENCE[2 + pair]
    r = beta * ((pc - rc) - (pr - rr))
    g = (REWARDS[pair] - REWARDS[2 + pair]) * scale
    return {
        "dpo": -(1 - eps) * logsig(r) - eps * logsig(-r),
        "scale": abs(REWARDS[pair] - REWARDS[2 + pair]) * -logsig(r),
        "ipo": (r / beta - 1 / (2 * beta)) ** 2,
        "rpo_sq": (r - g) ** 2,
        "rpo_bwd_kl": sig(g) * (logsig(g) - logsig(r)) + sig(-g) * (logsig(-g) - logsig(-r)),
        "rpo_fwd_kl": sig(r) * (logsig(r) - logsig(g)) + sig(-r) * (logsig(-r) - logsig(-g)),
    }[kind]


@pytest.mark.parametrize("kind", ["dpo", "scale", "ipo", "rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl"])
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_each_preference_loss_equals_the_hand_computation(kind: str, beta: float):
    opts = PreferenceOptions(preference_loss=kind, beta=beta, gt_reward_scale=0.5)
    loss, r = preference_terms(torch.tensor(POLICY, dtype=torch.float64), torch.tensor(REFERENCE, dtype=torch.float64),
                               torch.tensor(REWARDS, dtype=torch.float64), opts)
    assert loss.dtype == torch.float64
    for pair in range(2):
        assert float(loss[pair]) == pytest.approx(hand(kind, beta, pair, scale=0.5), rel=1e-9, abs=1e-12)
        expected_r = beta * ((POLICY[pair] - REFERENCE[pair]) - (POLICY[2 + pair] - REFERENCE[2 + pair]))
        assert float(r[pair]) == pytest.approx(expected_r, rel=1e-12)


def test_label_smoothing_is_conservative_dpo():
    opts = PreferenceOptions(beta=0.3, label_smoothing=0.2)
    loss, _ = preference_terms(torch.tensor(POLICY, dtype=torch.float64), torch.tensor(REFERENCE, dtype=torch.float64),
                               torch.tensor(REWARDS, dtype=torch.float64), opts)
    for pair in range(2):
        assert float(loss[pair]) == pytest.approx(hand("dpo", 0.3, pair, eps=0.2), rel=1e-9)
        assert float(loss[pair]) != pytest.approx(hand("dpo", 0.3, pair), rel=1e-6)   # eps changes it


class _Logprobs(Preference):
    """The loss with its token log-probs given directly (the model's output IS the [b, s-1]
    log-probs): what the test controls is everything after the LM head."""

    def token_logprobs(self, output, mb):
        return output


def _loss(**options) -> Preference:
    spec = loss_spec("preference")
    return _Logprobs(spec.parse_options(options), ModelConfig())


# two pairs, 4 positions; response masks differ in length so that sum and mean differ
TOKENS = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.2, -0.3, 0.0, 0.0],     # chosen 0, chosen 1
                       [-1.5, -1.5, -1.0, -0.5], [-2.0, -0.1, 0.0, 0.0]],   # rejected 0, rejected 1
                      dtype=torch.float64)
REF_TOKENS = torch.tensor([[-1.1, -0.4, -1.0, 0.0], [-0.3, -0.3, 0.0, 0.0],
                           [-1.0, -1.0, -1.0, -1.0], [-1.0, -0.5, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)


def _mb(rewards: list[float]) -> dict:
    return {"tokens": torch.zeros(4, 5, dtype=torch.long), "lengths": torch.tensor([5, 5, 5, 5]), "mask": MASK,
            "real": torch.tensor([1.0, 1.0]), "rewards": torch.tensor(rewards, dtype=torch.float64),
            "ref_logp": REF_TOKENS, "norm": 2.0}


def _seq(t: torch.Tensor, i: int, average: bool) -> float:
    vals = [float(t[i, j]) for j in range(4) if MASK[i, j]]
    return sum(vals) / len(vals) if average else sum(vals)


@pytest.mark.parametrize("average", [False, True])
def test_the_loss_sums_or_averages_tokens_and_adds_the_sft_term(average: bool):
    beta, w_pref, w_sft = 0.5, 0.7, 0.3
    loss = _loss(preference_loss="dpo", beta=beta, average_log_probs=average, preference_weight=w_pref,
                 sft_weight=w_sft)
    value, sums = loss(TOKENS, _mb([float("nan")] * 4))
    total = 0.0
    for pair in range(2):
        pc, pr = _seq(TOKENS, pair, average), _seq(TOKENS, 2 + pair, average)
        rc, rr = _seq(REF_TOKENS, pair, average), _seq(REF_TOKENS, 2 + pair, average)
        r = beta * ((pc - rc) - (pr - rr))
        sft = -_seq(TOKENS, pair, True)   # the chosen response's mean token NLL, whatever `average`
        total += w_pref * -logsig(r) + w_sft * sft
    assert float(value) == pytest.approx(total / 2.0, rel=1e-9)   # divided by the global pair count
    assert float(sums["loss_sum"]) == pytest.approx(total, rel=1e-9)


def test_rows_without_rewards_take_the_configured_defaults():
    loss = _loss(preference_loss="rpo_sq", beta=0.2, default_chosen_reward=3.0, default_rejected_reward=-1.0)
    with_defaults, _ = loss(TOKENS, _mb([float("nan"), 5.0, float("nan"), 0.0]))
    explicit, _ = loss(TOKENS, _mb([3.0, 5.0, -1.0, 0.0]))
    assert float(with_defaults) == pytest.approx(float(explicit), rel=1e-12)
    other, _ = loss(TOKENS, _mb([0.0, 5.0, 0.0, 0.0]))
    assert float(other) != pytest.approx(float(explicit), rel=1e-6)


def test_filler_pairs_do_not_count():
    loss = _loss(preference_loss="ipo", beta=0.4)
    mb = _mb([float("nan")] * 4)
    full, _ = loss(TOKENS, mb)
    mb["real"] = torch.tensor([1.0, 0.0])
    one, sums = loss(TOKENS, mb)
    assert float(sums["pairs"]) == 1.0
    assert float(one) == pytest.approx(hand_ipo_pair0(0.4) / 2.0, rel=1e-9) and float(one) != float(full)


def hand_ipo_pair0(beta: float) -> float:
    pc, pr = _seq(TOKENS, 0, False), _seq(TOKENS, 2, False)
    rc, rr = _seq(REF_TOKENS, 0, False), _seq(REF_TOKENS, 2, False)
    r = beta * ((pc - rc) - (pr - rr))
    return (r / beta - 1 / (2 * beta)) ** 2
