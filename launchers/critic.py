"""Critic component entry inside a job: `python launchers/critic.py --run-dir RUN_DIR`."""

import sys

from slurm_align.critic.main import cli

if __name__ == "__main__":
    sys.exit(cli())
