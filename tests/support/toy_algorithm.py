"""A toy RL algorithm registered from outside the library, as a user's plugin module would
(a run config lists it under `plugins:`; tests/integration/test_algorithm_registry.py runs it). Not a test.

toy_batch_mean: REINFORCE with the step's mean reward as the baseline (one sample per prompt, no
groups, no value model): advantage = reward - mean reward of the whole step (all DP ranks), on
every response token; return = reward.
"""

from __future__ import annotations

from slurm_align.algorithms import advantages as A
from slurm_align.algorithms.advantages import register_estimator
from slurm_align.algorithms.rollout_batch import all_reduce_sums
from slurm_align.config.algorithms import AlgorithmSpec, register

SPEC = register(AlgorithmSpec("toy_batch_mean", rollout=True, estimator="toy_batch_mean", loss="policy"))


@register_estimator("toy_batch_mean")
def batch_mean_baseline(run, batch, dp_group, kl_coef: float):
    reward = batch["reward"].float()
    s = all_reduce_sums({"sum": reward.double().sum(), "n": batch.size}, dp_group)
    baseline = s["sum"] / max(s["n"], 1.0)
    return A.per_token(reward - baseline, batch.mask), A.per_token(reward, batch.mask)


def length_reward(response: str, prompt: str, **fields) -> float:
    """A graded rule reward that a random policy already spreads (response length)."""
    return len(response) / 10.0


def char_code_reward(response: str, prompt: str, **fields) -> float:
    """A rule reward that spreads within every group even for a random-init policy's responses of
    equal length (byte tokens: ASCII characters count by their code, the rest alike)."""
    return sum(ord(c) for c in response if ord(c) < 128) / 1000.0
