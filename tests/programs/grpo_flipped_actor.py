"""A deliberately broken policy-gradient actor: the learning tests check that this one FAILS to
raise the held-out accuracy, so they can tell a working algorithm from a broken one.
GRPO, RLOO and REINFORCE++: the advantage's sign is flipped. Rejection sampling: the worst sample
of each group is kept instead of the best."""

import argparse


def flipped(estimate):
    def flipped_estimate(*args, **kwargs):
        advantages, returns = estimate(*args, **kwargs)
        return -advantages, returns
    return flipped_estimate


def keep_worst(keep_best, best_of_groups):
    def keep(batch):
        """keep_best with the rewards negated: the worst sample of each group is trained on."""
        reward = batch["reward"]
        worst = best_of_groups(-reward.float(), batch["group"])
        metrics = keep_best(batch)
        batch.set_samples("train", worst)
        return {**metrics, "kept_reward_sum": float((reward.float() * worst).sum()), "kept": float(worst.sum())}
    return keep


# Imports under the guard: spawned helpers (megatron's checkpoint writer) re-run this file as
# __mp_main__ and would import torch and megatron again for nothing.
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave

    with importing():   # as the product's launchers import
        from slurm_align.algorithms import advantages, policy_gradient, ppo
        from slurm_align.algorithms.rejection_sampling import best_of_groups

    for name in ("grpo", "rloo", "reinforce_pp"):
        advantages.ESTIMATORS[name] = flipped(advantages.ESTIMATORS[name])
    policy_gradient.keep_best = keep_worst(policy_gradient.keep_best, best_of_groups)
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    leave(ppo.main(parser.parse_args().run_dir))   # as the product's launchers end
