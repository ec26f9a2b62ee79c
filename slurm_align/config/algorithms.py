"""The algorithms as registered objects: what config validation, rendering, sweeps and the loops
ask about an algorithm, instead of comparing its name.

Torch-free (the login node validates configs with it). An algorithm's advantage estimator is
named here and registered where it runs (algorithms/advantages.py, `register_estimator`);
a new algorithm is one `register(AlgorithmSpec(...))` (plus its estimator, when new), e.g. in a
module a run config lists under `plugins:`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    """The value of RunConfig.algorithm."""
    rollout: bool
    """Generates rollouts in the actor loop (algorithms/ppo.py); False: a one-component trainer."""
    estimator: str | None = None
    """Advantage estimator (advantages.ESTIMATORS) of a rollout algorithm; None for
    best-of-n (loss 'sft') and the trainers."""
    loss: Literal["policy", "sft"] | None = None
    """The actor's update: the clipped policy loss, or SFT on kept samples; None for trainers."""
    value_model: bool = False
    """Trains a value model on the critic component (PPO)."""
    kl_in_reward: bool = False
    """Default of rl.kl_in_reward: the KL penalty sits in the reward."""
    min_group_size: int = 1
    """Smallest rl.n_samples_per_prompt (group baselines compare the samples of one prompt)."""
    group_filter: bool = True
    """Allows rl.filter_equal_reward_groups (dropping groups without any advantage)."""
    sweep_batch: str = "ppo.num_rollout_samples"
    """The dotted config field a weak-scaling sweep multiplies with the node count."""
    trainer: str | None = None
    """The registered loss (losses/registry.py) a one-component trainer (algorithms/trainer.py)
    trains with by default; RunConfig.loss.name may pick another."""


REGISTRY: dict[str, AlgorithmSpec] = {}
"""Registered algorithms by name."""


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in REGISTRY and REGISTRY[spec.name] != spec:
        raise ValueError(f"algorithm {spec.name!r} is already registered (differently)")
    if spec.rollout and (spec.loss is None or (spec.loss == "policy") != (spec.estimator is not None)):
        raise ValueError(f"algorithm {spec.name!r}: a rollout algorithm has loss 'policy' with an estimator, "
                         "or loss 'sft' without one")
    if not spec.rollout and spec.trainer is None:
        raise ValueError(f"algorithm {spec.name!r}: a one-component algorithm needs trainer='<registered loss>'")
    REGISTRY[spec.name] = spec
    return spec


def algorithm_spec(name: str) -> AlgorithmSpec:
    """The registered algorithm `name` (ValueError listing the registered ones otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"algorithm {name!r} is not registered; allowed: {', '.join(REGISTRY)}")
    return REGISTRY[name]


_TRAINER = "trainer.global_batch_size"
for _spec in (
    AlgorithmSpec("ppo", rollout=True, estimator="gae", loss="policy", value_model=True, kl_in_reward=True,
                  group_filter=False),
    AlgorithmSpec("sft", rollout=False, sweep_batch=_TRAINER, trainer="nll"),
    AlgorithmSpec("rm", rollout=False, sweep_batch=_TRAINER, trainer="bradley_terry"),
    AlgorithmSpec("dpo", rollout=False, sweep_batch=_TRAINER, trainer="preference"),
    AlgorithmSpec("kto", rollout=False, sweep_batch=_TRAINER, trainer="kto"),
    AlgorithmSpec("kd", rollout=False, sweep_batch=_TRAINER, trainer="kd"),
    AlgorithmSpec("grpo", rollout=True, estimator="grpo", loss="policy", min_group_size=2),
    AlgorithmSpec("rloo", rollout=True, estimator="rloo", loss="policy", min_group_size=2),
    AlgorithmSpec("reinforce_pp", rollout=True, estimator="reinforce_pp", loss="policy", kl_in_reward=True),
    AlgorithmSpec("rejection_sampling", rollout=True, loss="sft", min_group_size=2),
):
    register(_spec)
