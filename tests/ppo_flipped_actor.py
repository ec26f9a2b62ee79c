"""A deliberately broken PPO actor: the advantage sign is flipped. The learning test checks that
this one FAILS to learn, so the test can tell a working PPO from a broken one."""

import argparse
import sys

from slurm_align.algorithms import ppo, ppo_math

_gae = ppo_math.gae


def flipped_gae(*args, **kwargs):
    advantages, returns = _gae(*args, **kwargs)
    return -advantages, returns


if __name__ == "__main__":
    ppo_math.gae = flipped_gae
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(parser.parse_args().run_dir))
