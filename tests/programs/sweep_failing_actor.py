"""The `report` launcher, except that a 2-rank actor fails after reporting: the sweep point
with 2 actor nodes fails for real, the 1-node point completes."""

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys

from mpi4py import MPI

from slurm_align.launchers.report import main

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

if __name__ == "__main__":
    code = main()
    if MPI.COMM_WORLD.Get_size() == 2:
        print("the 2-node point fails on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    sys.exit(code)
