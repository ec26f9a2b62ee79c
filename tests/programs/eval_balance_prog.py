"""Evaluation's prompt batches on real MPI ranks (mpirun -n 2): algorithms/evaluation.py
prompt_batches, which evaluate() and evaluate_sampled() iterate. Rank 1 is slow (20 ms per
batch): with the work-stealing server (switches.dynamic_prompts) rank 0 takes more of the 60
prompts; static, each takes its strided half. Every prompt is handed out once either way.
Rank 0 prints one JSON line per mode."""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import time
from collections import Counter
from types import SimpleNamespace

from mpi4py import MPI

from slurm_align.algorithms.evaluation import prompt_batches

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
layout = SimpleNamespace(is_requester=True, mp_comm=MPI.COMM_SELF, dp_rank=rank, dp_size=size)

for dynamic in (True, False):
    collector = SimpleNamespace(run=SimpleNamespace(switches=SimpleNamespace(dynamic_prompts=dynamic)))
    mine: list[int] = []
    for idx in prompt_batches(collector, layout, comm, 60, 2):
        mine += idx
        if rank == 1:
            time.sleep(0.02)
    every = comm.gather(mine, root=0)
    if rank == 0:
        assert Counter(i for part in every for i in part) == Counter(range(60)), every
        print(json.dumps({"dynamic": dynamic, "per_rank": [len(p) for p in every]}), flush=True)
