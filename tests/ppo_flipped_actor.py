"""A deliberately broken PPO actor: the advantage sign is flipped. The learning test checks that
this one FAILS to learn, so the test can tell a working PPO from a broken one."""

import argparse
import sys



def flipped(gae):
    def flipped_gae(*args, **kwargs):
        advantages, returns = gae(*args, **kwargs)
        return -advantages, returns
    return flipped_gae


# Imports under the guard: spawned helpers (megatron's checkpoint writer) re-run this file as
# __mp_main__ and would import torch and megatron again for nothing.
if __name__ == "__main__":
    from slurm_align.algorithms import ppo, ppo_math

    ppo_math.gae = flipped(ppo_math.gae)
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(parser.parse_args().run_dir))
