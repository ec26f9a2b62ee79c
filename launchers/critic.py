"""Critic component entry inside a job: `python -m slurm_align.launchers.critic --run-dir RUN_DIR`."""

import sys

from slurm_align.critic.main import cli

if __name__ == "__main__":
    sys.exit(cli())
