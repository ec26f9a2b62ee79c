"""For humans: `python -m tests.cluster up|down|status [--workdir DIR] [--nodes N]`.

`up` starts the cluster and leaves it running (state in DIR/cluster.json) and prints the
`export SLURM_CONF=...` line to paste; `down` cancels its jobs and stops it by PID.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .cluster import ClusterError, LocalSlurmCluster
from .procs import alive

DEFAULT_WORKDIR = Path("/tmp/slurm-align-cluster")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    parser.add_argument("--nodes", type=int, default=4, help="number of slurmd (up only)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs per node (up only)")
    args = parser.parse_args(argv)
    state = args.workdir / "cluster.json"
    running = state.exists() and bool(LocalSlurmCluster.attach(args.workdir).pids)

    if args.action == "up":
        if running:
            print(f"already up in {args.workdir}: python -m tests.cluster down --workdir {args.workdir}")
            return 1
        cluster = LocalSlurmCluster(args.workdir, n_nodes=args.nodes, cpus_per_node=args.cpus)
        t0 = time.monotonic()
        try:
            cluster.start()
        except ClusterError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"up in {time.monotonic() - t0:.1f} s: nodes {','.join(cluster.nodes)}, "
              f"partition {cluster.partition}, logs in {cluster.log_dir}")
        print(f"export SLURM_CONF={cluster.conf_path}")
        return 0

    if not running:
        print(f"no cluster running in {args.workdir}")
        return 0 if args.action == "down" else 1
    cluster = LocalSlurmCluster.attach(args.workdir)
    if args.action == "down":
        t0 = time.monotonic()
        cluster.stop()
        print(f"down in {time.monotonic() - t0:.1f} s (workdir kept: {args.workdir})")
        return 0
    for name, pid in cluster.pids.items():
        print(f"{name:10s} pid {pid:7d} {'running' if alive(pid) else 'GONE'}")
    try:
        print(cluster.run("sinfo", "-N", "-o", "%N %P %t %c", timeout=15).stdout, end="")
    except Exception as exc:  # the human wants to see why, not a traceback
        print(f"sinfo failed: {exc}")
    print(f"export SLURM_CONF={cluster.conf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
