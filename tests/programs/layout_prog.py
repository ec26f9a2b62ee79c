"""Bootstrap + megatron layout + refold on 4 real ranks (gloo); run under mpirun -n 4.

For each (TP, PP, DP) the ranks megatron assigns, the generation layout with refold on and off,
and the generation process groups are checked against the formulas; then prompts are served
to one requester per generation replica and broadcast within it. Rank 0 prints LAYOUT_OK.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import os
import socket
import sys
import time
from collections import Counter

_T0 = time.perf_counter()
import torch
import torch.distributed as dist

torch.set_num_threads(1)

from slurm_align.balance.replica import open_prompt_source, replica_batches
from slurm_align.config.errors import ConfigError
from slurm_align.parallel.bootstrap import BootstrapError, init_distributed, shutdown_distributed
from slurm_align.parallel.layout import LayoutNotInitialised, initialize_model_parallel

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()


def group_ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def check_config(env, tp: int, pp: int) -> dict:
    world, rank = env.world_size, env.rank
    dp = world // (tp * pp)
    pctx = initialize_model_parallel(env, tp, pp)
    # Megatron's ranks vs rank = tp_rank + tp*(dp_rank + dp*pp_rank).
    assert rank == pctx.tp_rank + tp * (pctx.dp_rank + dp * pctx.pp_rank), (rank, tp, pp)
    assert (pctx.tp_size, pctx.pp_size, pctx.dp_size) == (tp, pp, dp)
    assert pctx.is_first_stage == (pctx.pp_rank == 0) and pctx.is_last_stage == (pctx.pp_rank == pp - 1)
    assert group_ranks(pctx.tp_group) == [r for r in range(world) if r // tp == rank // tp]
    assert group_ranks(pctx.dp_group) == [
        r for r in range(world) if r % tp == pctx.tp_rank and r // (tp * dp) == pctx.pp_rank
    ]
    assert group_ranks(pctx.pp_group) == [r for r in range(world) if r % (tp * dp) == rank % (tp * dp)]

    with pctx.generation_layout(refold=True) as gl:
        assert gl.dp_rank == pctx.dp_rank + pctx.dp_size * pctx.pp_rank, "refold formula"
        assert (gl.dp_size, gl.tp_rank, gl.tp_size, gl.pp_rank, gl.pp_size) == (dp * pp, pctx.tp_rank, tp, 0, 1)
        assert gl.dp_comm.Get_size() == dp * pp and gl.dp_comm.Get_rank() == gl.dp_rank
        assert group_ranks(gl.dp_group) == [r for r in range(world) if r % tp == pctx.tp_rank]
        assert group_ranks(gl.tp_group) == group_ranks(pctx.tp_group)
        # The generation DP group really communicates: sum of dp_gen ranks.
        t = torch.tensor([float(gl.dp_rank)])
        dist.all_reduce(t, group=gl.dp_group)
        assert t.item() == sum(range(dp * pp)), t
        assert gl.is_requester == (pctx.tp_rank == 0)
        # Prompts built inside the layout: one requester per TP group, broadcast to its peers.
        for dynamic in (True, False):
            src = open_prompt_source(env.comm, gl, 29, dynamic=dynamic)
            batches = [b.tolist() for b in replica_batches(gl, src, 3)]
            src.close()
            peers = gl.mp_comm.allgather(batches)
            assert all(p == batches for p in peers), "TP peers saw different batches"
            firsts = env.comm.gather([i for b in batches for i in b] if gl.is_requester else [], root=0)
            if rank == 0:
                assert Counter(i for p in firsts for i in p) == Counter(range(29)), (dynamic, firsts)
        refold_on = env.comm.gather(gl.dp_rank, root=0)

    with pctx.generation_layout(refold=False) as gl:
        assert (gl.dp_rank, gl.dp_size, gl.pp_rank, gl.pp_size) == (pctx.dp_rank, dp, pctx.pp_rank, pp)
        assert gl.is_requester == (pctx.tp_rank == 0 and pctx.pp_rank == 0)
        assert gl.mp_comm.Get_size() == tp * pp
        src = open_prompt_source(env.comm, gl, 17, dynamic=True)
        batches = [b.tolist() for b in replica_batches(gl, src, 4)]
        src.close()
        assert all(p == batches for p in gl.mp_comm.allgather(batches))

    # The training-DP MPI communicator (for rebalance) has the training DP peers.
    assert pctx.dp_comm.Get_size() == dp and pctx.dp_comm.Get_rank() == pctx.dp_rank
    pctx.destroy()
    try:
        _ = pctx.tp_rank   # the getter must raise once destroyed
    except LayoutNotInitialised as exc:
        assert "destroy" in str(exc)
    else:
        raise AssertionError("getter after destroy() did not raise")
    return {"tp": tp, "pp": pp, "dp": dp, "dp_gen_by_rank": refold_on}


def port_in_use_fails_everywhere() -> None:
    """MASTER_PORT pointing at a port someone listens on: every rank gets the same clear error."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    holder = None
    if comm.Get_rank() == 0:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
    port = comm.bcast(holder.getsockname()[1] if holder else None, root=0)
    os.environ["MASTER_PORT"] = str(port)
    try:
        init_distributed()
    except BootstrapError as exc:
        assert f"127.0.0.1:{port}" in str(exc) and "in use" in str(exc), exc
    else:
        raise AssertionError("init_distributed with a busy MASTER_PORT did not raise")
    finally:
        del os.environ["MASTER_PORT"]
        if holder:
            holder.close()
    assert not dist.is_initialized()


def main() -> None:
    import megatron.core.parallel_state  # noqa: F401  (timed: most of this program's run time)

    t_import = time.perf_counter() - _T0
    port_in_use_fails_everywhere()
    env = init_distributed()
    assert env.world_size == 4 and env.backend == "gloo" and env.device == "cpu"
    info = env.comm.gather((env.rank, env.local_rank, env.local_size, env.node_rank, env.num_nodes), root=0)
    t1 = time.perf_counter()
    results = [check_config(env, tp, pp) for tp, pp in ((1, 1), (1, 2), (2, 2))]
    t_checks = time.perf_counter() - t1
    try:
        initialize_model_parallel(env, 3, 1)
    except ConfigError as exc:
        assert "parallel.tensor_parallel" in str(exc) and "divide" in str(exc), exc
    else:
        raise AssertionError("tp=3 on 4 ranks did not raise ConfigError")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4
    if env.rank == 0:
        print(json.dumps({"ranks": info, "addr": env.master_addr, "configs": results,
                          "seconds": {"import": round(t_import, 1), "checks": round(t_checks, 1)}}), flush=True)
        print("LAYOUT_OK", flush=True)
    shutdown_distributed(env)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    sys.stdout.flush()
