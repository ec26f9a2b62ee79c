"""A deliberately broken GRPO/RLOO actor: the group advantage's sign is flipped. The learning
test checks that this one FAILS to raise the held-out accuracy, so the test can tell a working
estimator from a broken one."""

import argparse
import sys

from slurm_align.algorithms import advantages, ppo

_grpo, _rloo = advantages.grpo, advantages.rloo


def flipped_grpo(*args, **kwargs):
    return -_grpo(*args, **kwargs)


def flipped_rloo(*args, **kwargs):
    return -_rloo(*args, **kwargs)


if __name__ == "__main__":
    advantages.grpo, advantages.rloo = flipped_grpo, flipped_rloo
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(parser.parse_args().run_dir))
