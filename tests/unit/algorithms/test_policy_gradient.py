"""The advantage dispatch of the actor loop (policy_gradient.estimate_advantages) for every
registered rollout algorithm, on one fixed batch, against an independent computation of that
algorithm's published formula here (numpy float64, per-sample loops; none of the library's
helpers): advantages, returns, values, the 'train' weights and the metrics.

The algorithms come from the registry itself (config/algorithms.py REGISTRY), so a newly
registered one is collected here too, and fails until a reference formula is added to
REFERENCES below. The one-component trainers (sft, rm, dpo) have no rollouts and no advantages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from slurm_align.algorithms.policy_gradient import estimate_advantages
from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.config import RunConfig
from slurm_align.config.algorithms import REGISTRY, AlgorithmSpec

# -- the fixed batch ---------------------------------------------------------------------------
# Three groups of different sizes: 5 (rewards 1, 0, 0.5), 8 (2, 2: all equal, so no group
# advantage and the equal-reward filter drops it), 3 (-1, 0.25, 0.75). Responses of different
# lengths, so padding sits inside the [B, T] columns.
GROUP = np.array([5, 5, 5, 8, 8, 3, 3, 3])
REWARD = np.array([1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 0.25, 0.75])
PROMPT_LEN = np.array([2, 3, 2, 1, 2, 3, 2, 2])
RESPONSE_LEN = np.array([3, 5, 2, 4, 4, 1, 5, 3])
B, T = len(GROUP), int(RESPONSE_LEN.max())
MASK = (np.arange(T)[None, :] < RESPONSE_LEN[:, None]).astype(np.float64)
_rng = np.random.default_rng(0)
LOGP = -_rng.uniform(0.1, 3.0, (B, T)) * MASK
REF_LOGP = -_rng.uniform(0.1, 3.0, (B, T)) * MASK
VALUES = _rng.normal(0.0, 1.0, (B, T)) * MASK

KL_COEF, GAMMA, LAM = 0.1, 0.9, 0.8


def make_batch() -> RolloutBatch:
    """The batch as the actor loop hands it over: rewards, groups, log-probs and values."""
    g = np.random.default_rng(1)
    batch = RolloutBatch.from_sequences([g.integers(1, 250, p) for p in PROMPT_LEN],
                                        [g.integers(1, 250, r) for r in RESPONSE_LEN],
                                        pad_id=0, index=np.arange(B), group=GROUP,
                                        reward=REWARD.astype(np.float32), is_end=np.ones(B, dtype=bool))
    for name, col in (("logprobs", LOGP), ("ref_logprobs", REF_LOGP), ("values", VALUES)):
        batch.set_tokens(name, torch.from_numpy(col))
    return batch


# -- reference formulas, by hand ------------------------------------------------------------------
def _kl(run: RunConfig) -> float:
    """The KL coefficient in the reward: ppo.kl_coef where the run puts the KL there."""
    return run.ppo.kl_coef if run.kl_in_reward else 0.0


def _token_rewards(kl: float) -> np.ndarray:
    """-kl * (log pi - log pi_ref) on each response token, the score added on the last one."""
    r = np.zeros((B, T))
    for i in range(B):
        n = RESPONSE_LEN[i]
        r[i, :n] = -kl * (LOGP[i, :n] - REF_LOGP[i, :n])
        r[i, n - 1] += REWARD[i]
    return r


def _whiten(x: np.ndarray) -> np.ndarray:
    """(x - mean) / sqrt(var + 1e-8) over the batch's response tokens (population variance)."""
    valid = x[MASK > 0]
    return (x - valid.mean()) / np.sqrt(valid.var() + 1e-8) * MASK


def _groups() -> dict[int, list[int]]:
    return {int(g): [i for i in range(B) if GROUP[i] == g] for g in np.unique(GROUP)}


def _on_tokens(per_sample: np.ndarray) -> np.ndarray:
    return per_sample[:, None] * MASK


def _equal_reward_filter(run: RunConfig) -> tuple[np.ndarray, dict[str, float]]:
    """DAPO's dynamic sampling (any policy-loss algorithm that allows it): train weight 0 for the
    groups whose rewards (the scores, before any KL penalty) are all equal."""
    train = np.ones(B)
    if not run.rl.filter_equal_reward_groups:
        return train, {}
    dropped = [g for g, rows in _groups().items() if len({REWARD[i] for i in rows}) == 1]
    for g in dropped:
        train[_groups()[g]] = 0.0
    return train, {"dropped_groups": float(len(dropped)), "dropped_group_fraction": len(dropped) / len(_groups())}


def _sequence_returns(run: RunConfig) -> np.ndarray:
    """A sample's score minus its summed KL penalty (the group estimators' return)."""
    return np.array([REWARD[i] - _kl(run) * (LOGP[i] - REF_LOGP[i]).sum() for i in range(B)])


def ref_gae(run: RunConfig) -> dict[str, Any]:
    """PPO (Schulman et al., 2017): GAE over each response, value 0 after its last token,
    advantages whitened over the batch; returns = advantages + values (before whitening)."""
    r = _token_rewards(_kl(run))
    adv = np.zeros((B, T))
    for i in range(B):
        n, last = RESPONSE_LEN[i], 0.0
        for t in reversed(range(n)):
            next_value = VALUES[i, t + 1] if t + 1 < n else 0.0
            last = r[i, t] + run.ppo.gamma * next_value - VALUES[i, t] + run.ppo.gamma * run.ppo.lam * last
            adv[i, t] = last
    train, metrics = _equal_reward_filter(run)
    return {"advantages": _whiten(adv), "returns": (adv + VALUES) * MASK, "values": VALUES,
            "train": train, "metrics": metrics}


def ref_reinforce_pp(run: RunConfig) -> dict[str, Any]:
    """REINFORCE++ (Hu, 2025): undiscounted return-to-go of the KL-penalised token rewards,
    whitened over the batch; no critic (values 0)."""
    r = _token_rewards(_kl(run))
    returns = np.zeros((B, T))
    for i in range(B):
        for t in range(RESPONSE_LEN[i]):
            returns[i, t] = r[i, t:RESPONSE_LEN[i]].sum()
    train, metrics = _equal_reward_filter(run)
    return {"advantages": _whiten(returns), "returns": returns, "values": np.zeros((B, T)),
            "train": train, "metrics": metrics}


def ref_grpo(run: RunConfig) -> dict[str, Any]:
    """GRPO (Shao et al., 2024): (x - group mean) / (group std + 1e-6), std with n - 1; Dr. GRPO
    (rl.normalize_group_std false) without the division. All-equal groups get 0."""
    x, adv = _sequence_returns(run), np.zeros(B)
    for rows in _groups().values():
        g = x[rows]
        adv[rows] = g - g.mean()
        if run.rl.normalize_group_std:
            adv[rows] /= g.std(ddof=1) + 1e-6
    train, metrics = _equal_reward_filter(run)
    return {"advantages": _on_tokens(adv), "returns": _on_tokens(x), "values": np.zeros((B, T)),
            "train": train, "metrics": metrics}


def ref_rloo(run: RunConfig) -> dict[str, Any]:
    """RLOO (Ahmadian et al., 2024): x_i - the mean of the OTHER samples of its group."""
    x, adv = _sequence_returns(run), np.zeros(B)
    for rows in _groups().values():
        for i in rows:
            adv[i] = x[i] - np.mean([x[j] for j in rows if j != i])
    train, metrics = _equal_reward_filter(run)
    return {"advantages": _on_tokens(adv), "returns": _on_tokens(x), "values": np.zeros((B, T)),
            "train": train, "metrics": metrics}


def ref_rejection_sampling(run: RunConfig) -> dict[str, Any]:
    """Rejection sampling (best-of-n, SFT loss): train only on each group's best sample (the
    first on ties); a group whose rewards are all equal has no best. No advantages."""
    train = np.zeros(B)
    for rows in _groups().values():
        r = REWARD[rows]
        if r.max() > r.min():
            train[rows[int(np.argmax(r))]] = 1.0
    zeros = np.zeros((B, T))
    return {"advantages": zeros, "returns": zeros, "values": zeros, "train": train,
            "metrics": {"kept_rewards": float((REWARD * train).sum() / train.sum())}}


REFERENCES: dict[str, Callable[[RunConfig], dict[str, Any]]] = {
    "ppo": ref_gae,
    "reinforce_pp": ref_reinforce_pp,
    "grpo": ref_grpo,
    "rloo": ref_rloo,
    "rejection_sampling": ref_rejection_sampling,
}
"""Reference formula of each registered rollout algorithm. A new algorithm adds its own."""


# -- the runs ----------------------------------------------------------------------------------
def run_config(spec: AlgorithmSpec, variant: str) -> RunConfig:
    """'defaults': the algorithm's own choices (KL placement); 'options': the KL placement
    flipped, Dr. GRPO, and the equal-reward filter where the algorithm allows it."""
    rl: dict[str, Any] = {"n_samples_per_prompt": max(spec.min_group_size, 1)}
    if variant == "options":
        rl.update(kl_in_reward=not spec.kl_in_reward, normalize_group_std=False,
                  filter_equal_reward_groups=spec.group_filter)
    return RunConfig(algorithm=spec.name, rl=rl, reward={"rule": "slurm_align.rewards.sort:exact"},
                     ppo={"kl_coef": KL_COEF, "gamma": GAMMA, "lam": LAM})


def check_dispatch(name: str, variant: str) -> None:
    if name not in REFERENCES:
        pytest.fail(f"algorithm {name!r} is registered but has no reference formula in {__name__}.REFERENCES: "
                    "add an independent computation of its advantages there")
    run = run_config(REGISTRY[name], variant)
    batch = make_batch()
    metrics = estimate_advantages(run, batch, dp_group=None)
    want = REFERENCES[name](run)
    for col in ("advantages", "returns", "values"):
        got = batch[col].double().numpy()
        np.testing.assert_allclose(got, want[col], rtol=1e-5, atol=1e-5, err_msg=f"{name} ({variant}): {col}")
    np.testing.assert_array_equal(batch["train"].numpy(), want["train"], err_msg=f"{name} ({variant}): train")
    assert metrics.keys() == want["metrics"].keys()
    for k, v in want["metrics"].items():
        assert metrics[k] == pytest.approx(v), k


ROLLOUT_ALGORITHMS = sorted(name for name, spec in REGISTRY.items() if spec.rollout)


@pytest.mark.parametrize("variant", ["defaults", "options"])
@pytest.mark.parametrize("name", ROLLOUT_ALGORITHMS)
def test_each_registered_algorithm_dispatches_to_its_formula(name: str, variant: str) -> None:
    check_dispatch(name, variant)


def test_the_fixed_batch_tells_the_estimators_apart() -> None:
    """Every pair of references differs on the batch (else a dispatch to the wrong estimator
    could pass), and the options variant changes each algorithm's result."""
    results = {(n, v): REFERENCES[n](run_config(REGISTRY[n], v)) for n in REFERENCES for v in ("defaults", "options")}
    names = list(REFERENCES)
    for v in ("defaults", "options"):
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                same = all(np.allclose(results[a, v][c], results[b, v][c]) for c in ("advantages", "train"))
                assert not same, f"{a} and {b} agree on the fixed batch ({v})"
    for n in REFERENCES:
        if n != "rejection_sampling":   # best-of-n has no options that act
            assert not np.allclose(results[n, "defaults"]["advantages"], results[n, "options"]["advantages"]), n


def test_an_algorithm_without_a_reference_formula_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new registration (here a GRPO twin) is not covered until it has a reference."""
    monkeypatch.setitem(REGISTRY, "toy_unreferenced",
                        AlgorithmSpec("toy_unreferenced", rollout=True, estimator="grpo", loss="policy"))
    with pytest.raises(pytest.fail.Exception, match="'toy_unreferenced' is registered but has no reference"):
        check_dispatch("toy_unreferenced", "defaults")
