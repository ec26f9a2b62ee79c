"""A deliberately broken PPO actor: the advantage sign is flipped. The learning test checks that
this one FAILS to learn, so the test can tell a working PPO from a broken one."""

import argparse

from grpo_flipped_actor import flipped  # this script's folder is on sys.path

# Imports under the guard: spawned helpers (megatron's checkpoint writer) re-run this file as
# __mp_main__ and would import torch and megatron again for nothing.
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave

    with importing():   # as the product's launchers import
        from slurm_align.algorithms import advantages, ppo

    advantages.ESTIMATORS["gae"] = flipped(advantages.ESTIMATORS["gae"])
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    leave(ppo.main(parser.parse_args().run_dir))   # as the product's launchers end
