"""The ranks of an evaluation job (`slurm-align eval`): slurm_align.algorithms.eval_main.

Usage (the job script does this on each rank): python -m slurm_align.launchers.evaluate --run-dir RUN_DIR
"""

import argparse

if __name__ == "__main__":   # heavy imports under the guard, as launchers/actor.py explains
    from slurm_align.launchers import importing, leave

    with importing():
        from slurm_align.algorithms.eval_main import main

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    leave(main(parser.parse_args().run_dir))
