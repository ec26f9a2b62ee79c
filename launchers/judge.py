"""Judge component entry inside a job: `python -m slurm_align.launchers.judge --run-dir RUN_DIR`."""

import sys

if __name__ == "__main__":
    from slurm_align.judge.main import cli

    sys.exit(cli())
