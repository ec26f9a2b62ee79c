"""Entry of every rank of an sft / rm / dpo job: python -m slurm_align.launchers.train --run-dir RUN_DIR"""

import argparse

if __name__ == "__main__":  # the checkpoint writer re-imports __main__ (spawn): keep this guard
    from slurm_align.launchers import importing, leave
    from slurm_align.slurm.preemption import block_term

    block_term()   # before MPI, torch and their threads start: see slurm_align.slurm.preemption
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    args = ap.parse_args()
    with importing():
        from slurm_align.algorithms.train_main import main

    main(args.run_dir)
    leave(0)
