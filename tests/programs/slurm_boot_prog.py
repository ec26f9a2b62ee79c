"""Bootstrap under `srun --mpi=pmix`: ranks from PMIx, rendezvous, one gloo all_reduce.

Rank 0 prints a JSON line with what each rank saw, then SLURM_BOOT_OK.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import os

import torch
import torch.distributed as dist

from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def main() -> None:
    torch.set_num_threads(1)
    env = init_distributed()
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    seen = (env.rank, env.world_size, env.local_rank, env.local_size, env.node_rank, env.num_nodes,
            os.environ.get("SLURMD_NODENAME"), int(os.environ.get("SLURM_PROCID", -1)))
    every = env.comm.gather(seen, root=0)
    if env.rank == 0:
        print(json.dumps({"ranks": every, "sum": t.item(), "addr": env.master_addr}), flush=True)
        print("SLURM_BOOT_OK", flush=True)
    shutdown_distributed(env)


if __name__ == "__main__":
    main()
