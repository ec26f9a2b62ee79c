"""A deliberately broken policy-gradient actor: the learning tests check that this one FAILS to
raise the held-out accuracy, so they can tell a working algorithm from a broken one.
GRPO, RLOO and REINFORCE++: the advantage's sign is flipped. Rejection sampling: the worst sample
of each group is kept instead of the best."""

import argparse
import sys

from slurm_align.algorithms import advantages, policy_gradient, ppo
from slurm_align.algorithms.rejection_sampling import best_of_groups

_grpo, _rloo, _reinforce_pp, _keep_best = advantages.grpo, advantages.rloo, advantages.reinforce_pp, \
    policy_gradient.keep_best


def flipped_grpo(*args, **kwargs):
    return -_grpo(*args, **kwargs)


def flipped_rloo(*args, **kwargs):
    return -_rloo(*args, **kwargs)


def flipped_reinforce_pp(*args, **kwargs):
    return -_reinforce_pp(*args, **kwargs)


def keep_worst(batch):
    """keep_best with the rewards negated: the worst sample of each group is trained on."""
    reward = batch["reward"]
    worst = best_of_groups(-reward.float(), batch["group"])
    metrics = _keep_best(batch)
    batch.set_samples("train", worst)
    return {**metrics, "kept_reward_sum": float((reward.float() * worst).sum()), "kept": float(worst.sum())}


if __name__ == "__main__":
    advantages.grpo, advantages.rloo, advantages.reinforce_pp = flipped_grpo, flipped_rloo, flipped_reinforce_pp
    policy_gradient.keep_best = keep_worst
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(parser.parse_args().run_dir))
