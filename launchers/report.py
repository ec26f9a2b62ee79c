"""Each rank reports who and where it is, and where the other components are.

The smallest real launcher: used by the submit tests (a hetjob and the local profile must
give the same report) and by `slurm-align submit --entry report` to check a new profile.
Usage: python -m slurm_align.launchers.report --run-dir RUN_DIR [--fail-rank N]
"""

import argparse
import json
import os
import socket
import sys
import time

from slurm_align.rundir import RunDir, write_atomic
from slurm_align.slurm.hetenv import HetEnv


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--fail-rank", type=int, default=None,
                        help="this rank exits 3 after reporting (for failure tests)")
    parser.add_argument("--hold-s", type=float, default=0.0,
                        help="stay alive this long after reporting (for cancel tests)")
    args = parser.parse_args()

    from mpi4py import MPI  # initialises MPI from the launcher (srun --mpi=pmix or mpirun)

    comm = MPI.COMM_WORLD
    het = HetEnv.from_environ()
    report = {
        "component": het.component,
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "hosts": {c: het.hosts(c) for c in het.components},
        "addresses": {c: het.address(c) for c in het.components},
        "ntasks": {c: het.ntasks(c) for c in het.components},
    }
    print(json.dumps(report), flush=True)
    assert het.run_dir is not None, "the job script exports SLURM_ALIGN_RUN_DIR"
    write_atomic(RunDir(het.run_dir).report(het.component, comm.Get_rank()), json.dumps(report, indent=1))
    comm.Barrier()
    time.sleep(args.hold_s)
    if args.fail_rank is not None and comm.Get_rank() == args.fail_rank:
        print(f"rank {args.fail_rank} fails on purpose", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main())
