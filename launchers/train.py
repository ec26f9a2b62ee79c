"""Entry of every rank of an sft / rm / dpo job: python -m slurm_align.launchers.train --run-dir RUN_DIR"""

import argparse

if __name__ == "__main__":  # the checkpoint writer re-imports __main__ (spawn): keep this guard
    from slurm_align.slurm.preemption import block_term

    block_term()   # before MPI, torch and their threads start: see slurm_align.slurm.preemption
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args()
    from slurm_align.algorithms.train_main import main
    from slurm_align.launchers import leave

    main(args.run_dir)
    leave(0)
