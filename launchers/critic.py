"""Critic component entry inside a job: `python -m slurm_align.launchers.critic --run-dir RUN_DIR`."""

import sys

from slurm_align.algorithms.preemption import block_term

block_term()   # before MPI, tritonserver and their threads start: see slurm_align.algorithms.preemption

from slurm_align.critic.main import cli  # noqa: E402  (after block_term, on purpose)

if __name__ == "__main__":
    sys.exit(cli())
