"""One actor-like rank (MPI COMM_SELF) under a blocked SIGTERM, as the launchers run under Slurm:
a loop of steps of given lengths, each committed as a checkpoint folder, with the real StopPoint
deciding at a TERM sent to itself during one step. For tests/integration/test_slurm_preemption.py.

    python -m tests.programs.term_stop_worker RUN_DIR STEP_SECONDS(comma list) TERM_STEP [LINGER_S]
Exit 0; prints 'stopped at the boundary of step N' when the loop stopped there, else (after
LINGER_S more seconds, as an actor shutting down) 'ran to the end'.
"""

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import os
import signal
import sys
import time
from pathlib import Path

from slurm_align.slurm.preemption import block_term

assert block_term(), "SLURM_JOB_ID must be set"

from mpi4py import MPI

from slurm_align.rundir import RunDir
from slurm_align.slurm.preemption import StopPoint

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

if __name__ == "__main__":
    rd = RunDir(Path(sys.argv[1]))
    seconds = [float(s) for s in sys.argv[2].split(",")]
    term_step = int(sys.argv[3])
    stop = StopPoint(MPI.COMM_SELF, rd)
    stop.resumed(1, None)
    for step, length in enumerate(seconds, start=1):
        stop.step_begins()
        if step == term_step:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(length)
        folder = rd.checkpoints("actor") / f"iter_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")   # committed: what find_latest takes
        if stop.after_step(step, last=step == len(seconds), saved=True, save=lambda s: None):
            print(f"stopped at the boundary of step {step}", flush=True)
            sys.exit(0)
    time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    print("ran to the end", flush=True)
