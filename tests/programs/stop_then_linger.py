"""A component for tests of the job script's stop path (tests/integration/test_slurm_preemption.py), run in
place of the actor and the critic: the script's reaping is what is tested, not the models.

    actor   waits until RUN_DIR/test_go exists, then stops as the actor does after a stop request
            was agreed and every role saved (rank 0 writes RUN_DIR/stopped_step) and exits 0
    critic  writes RUN_DIR/test_critic_up and serves on (sleeps) until it is ended
Each wait has a ceiling (CEILING_S), after which the program fails, saying so.
"""

import os
import sys
import time
from pathlib import Path

CEILING_S = 600


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + CEILING_S
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"stop_then_linger: {path} did not appear in {CEILING_S} s")
        time.sleep(0.05)


def main() -> int:
    run_dir = Path(os.environ["SLURM_ALIGN_RUN_DIR"])
    component = os.environ["SLURM_ALIGN_COMPONENT"]
    rank = int(os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if component == "actor":
        wait_for(run_dir / "test_go")
        if rank == 0:
            tmp = run_dir / "stopped_step.tmp"
            tmp.write_text("3\n")
            tmp.rename(run_dir / "stopped_step")
        print("stop_then_linger: the actor stopped at step 3", flush=True)
        return 0
    (run_dir / "test_critic_up").write_text(str(os.getpid()))
    print("stop_then_linger: the critic serves", flush=True)
    wait_for(run_dir / "test_never")
    return 1


if __name__ == "__main__":
    sys.exit(main())
