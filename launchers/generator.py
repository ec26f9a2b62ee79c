"""The generator component of a disaggregated rollout run (rollout.mode 'disaggregated'):
every rank runs slurm_align.algorithms.generator.

Usage (the job script does this on each rank): python -m slurm_align.launchers.generator --run-dir RUN_DIR
"""

import argparse

# Under the guard: spawned helper processes re-run this module as __mp_main__ (see actor.py).
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave
    from slurm_align.slurm.preemption import block_term

    block_term()   # before MPI, torch and their threads start: see slurm_align.slurm.preemption
    with importing():
        from slurm_align.algorithms.generator import main

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    leave(main(parser.parse_args().run_dir))
