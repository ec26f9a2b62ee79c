"""Rank program that runs several actions of tests/programs/hf_worker.py and tests/programs/moe_worker.py, each at
its own layout, in ONE mpirun launch (not a test): every rank imports megatron once, not once
per layout (~4 s of CPU per rank and launch on the 2-core CI machine).

    python tests/programs/plan_worker.py PLAN.json

PLAN.json: a list of [worker, action, tp, pp, ep, dir] (worker "hf" or "moe"); for each, in
order, megatron's parallel state is set up at TP x PP x EP over all ranks, the action runs on
DIR as the worker's own command line would run it, and the state is destroyed again.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import sys
from pathlib import Path

import hf_worker
import moe_worker
import torch.distributed as dist

from slurm_align.parallel.bootstrap import init_distributed
from slurm_align.parallel.layout import initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

ACTIONS = {"hf": hf_worker.ACTIONS, "moe": moe_worker.ACTIONS}


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    env = init_distributed()
    for worker, action, tp, pp, ep, root in plan:
        pctx = initialize_model_parallel(env, tp, pp, ep)
        ACTIONS[worker][action](pctx, Path(root))
        dist.barrier()
        pctx.destroy()
    return 0


if __name__ == "__main__":
    from slurm_align.launchers import leave

    leave(main(sys.argv[1:]))   # as the product's launchers end
