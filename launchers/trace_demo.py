"""Synthetic PPO-shaped workload writing real spans and rollouts (slurm_align.analysis.synthetic).

For sweeps and analysis checks without the real PPO loop:
    slurm-align sweep CONFIG --profile NAME --nodes 1,2 --entry trace_demo
Usage: python launchers/trace_demo.py --run-dir RUN_DIR
"""

import argparse
from pathlib import Path

from slurm_align.analysis.synthetic import run
from slurm_align.slurm.hetenv import HetEnv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    from mpi4py import MPI  # initialises MPI from the launcher (srun --mpi=pmix or mpirun)
    run(Path(args.run_dir), HetEnv.from_environ().component, MPI.COMM_WORLD)


if __name__ == "__main__":
    main()
