"""The actor component of a PPO run: every rank runs the PPO loop (slurm_align.algorithms.ppo).

Usage (the job script does this on each rank): python -m slurm_align.launchers.actor --run-dir RUN_DIR
"""

import argparse

# Everything heavy stays under the guard: spawned helper processes (megatron's checkpoint writer,
# PyTriton's tensor store) re-run this module as __mp_main__, and would import torch and
# megatron again for nothing (~5 s of CPU each).
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave
    from slurm_align.slurm.preemption import block_term

    block_term()   # before MPI, torch and their threads start: see slurm_align.slurm.preemption
    with importing():
        from slurm_align.algorithms.ppo import main

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    leave(main(parser.parse_args().run_dir))
