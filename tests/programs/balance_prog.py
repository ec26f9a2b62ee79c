"""Prompt server, static sharding and rebalance on real MPI ranks (run under mpirun -n N).

Every scenario checks on rank 0 that the multiset of processed indices equals the dataset;
any failure raises, so mpirun exits non-zero. Rank 0 prints one JSON line per scenario.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from slurm_align.algorithms.rollout_batch import RolloutBatch
from slurm_align.balance.prompts import PromptServer
from slurm_align.balance.rebalance import RebalanceError, plan_groups, rebalance
from slurm_align.balance.static import StaticPrompts

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
side = comm.Dup()   # the stuck worker's barrier: a communicator of its own, apart from the server's traffic


def check_exact(name: str, mine: list[int], dataset: np.ndarray, extra: dict | None = None) -> list[list[int]]:
    every = comm.gather(mine, root=0)
    if rank == 0:
        got = Counter(i for part in every for i in part)
        want = Counter(dataset.tolist())
        if got != want:
            missing, dup = want - got, got - want
            raise AssertionError(f"{name}: missing {dict(missing)} extra {dict(dup)}")
        print(json.dumps({"scenario": name, "per_rank": [len(p) for p in every], **(extra or {})}), flush=True)
    return every


def run_dynamic(name: str, n: int, batch: int, *, stuck_rank: int | None = None, order=None,
                prefetch: bool = True):
    """`stuck_rank` takes its first batch before any other rank starts, then holds it until every
    other rank has run out of work: a worker as slow as that, whatever the load on the machine (a
    10x sleep lost to a loaded host's scheduler once: a "fast" rank starved as long as the slow
    one). Two non-blocking barriers on `side` order it: `first` (the stuck rank holds a batch) and
    `drained` (the others got nothing more). The root is a worker too and cannot leave batches()
    before the stuck rank is done, so it joins `drained` from on_wait once the server has handed
    out its last prompt, not after its loop (that waited for the stuck rank: a deadlock)."""
    waits: list[float] = []
    stuck = stuck_rank is not None and stuck_rank != rank   # an "other" rank of a stuck scenario
    drained: list = []

    def on_wait(dt: float) -> None:
        waits.append(dt)
        if stuck and rank == 0 and not drained and server.remaining == 0:
            drained.append(side.Ibarrier())

    def spin(req) -> None:   # wait without blocking in MPI beside the server thread (prompts.py)
        while not req.Test():
            time.sleep(0.01)

    kw = {"order": order} if order is not None else {"num_prompts": n}
    server = PromptServer(comm, requester=True, on_wait=on_wait, **kw)
    with server:
        if stuck:
            spin(side.Ibarrier())   # `first`: the stuck rank holds its first batch
        mine = []
        for chunk in server.batches(batch, prefetch=prefetch):
            assert 1 <= len(chunk) <= batch, (name, chunk)
            mine += chunk.tolist()
            if stuck_rank == rank and not drained:
                side.Ibarrier()   # `first`
                drained.append(side.Ibarrier())
                spin(drained[0])
        if stuck and not drained:
            drained.append(side.Ibarrier())
        assert len(server.wait_times) == len(waits) >= 1 and all(w >= 0 for w in waits)
    if drained:
        spin(drained[0])
    dataset = np.arange(n) if order is None else np.asarray(order)
    return check_exact(name, mine, dataset, {"requests": comm.gather(len(waits), root=0)})


def run_route(dp_size: int, group_size: int) -> None:
    """Uneven local rollouts (rank 1 generates nothing) -> each DP rank's planned share, on every
    rank of that DP rank (ranks r with r % dp_size == d: a stand-in for its TP x PP group)."""
    dp_rank = rank % dp_size
    n_groups = 6 * dp_size
    # Groups go round-robin to the ranks that generate (all but rank 1, unless alone).
    makers = [r for r in range(size) if r != 1] or [0]
    mine = [g for g in range(n_groups) if makers[g % len(makers)] == rank]
    index = [g * group_size + k for g in mine for k in range(group_size)]
    rng = np.random.default_rng(index[0] if index else 0)
    prompts = [np.full(1 + i % 3, i) for i in index]
    responses = [np.full(int(rng.integers(0, 9)), i) for i in index]
    local = RolloutBatch.from_sequences(prompts, responses, -1, index=np.array(index, dtype=np.int64),
                                        group=np.array(index, dtype=np.int64) // group_size,
                                        rank=np.full(len(index), rank))
    if local.size:
        local.set_tokens("values", local.mask * local["index"][:, None].float())
    route = local.route(comm, dp_rank, dp_size, expected=n_groups * group_size)
    shard = local.moved(route, per_token=[])

    # The plan every rank computes alike, from every sample's (length, group).
    meta = comm.allgather((local.seq_lengths.tolist(), local["group"].tolist() if local.size else []))
    lengths = [x for m in meta for x in m[0]]
    groups = [x for m in meta for x in m[1]]
    plan = plan_groups(lengths, groups, dp_size)
    want = sorted(g * group_size + k for g, d in plan.items() if d == dp_rank for k in range(group_size))
    assert shard["index"].tolist() == want, (rank, shard["index"].tolist(), want)   # its planned share
    for i in range(shard.size):   # payload intact: every token of sample i is i
        seq = shard.tokens[i, : int(shard.seq_lengths[i])]
        assert (seq == shard["index"][i]).all()
    # Equal counts, token loads within one group's weight, and nothing lost or doubled.
    loads = comm.allgather((dp_rank, shard.size, int(shard.seq_lengths.sum()), shard["index"].tolist()))
    firsts = {d: (n, load, idx) for d, n, load, idx in reversed(loads)}  # one member per DP rank
    assert all(firsts[d] == (n, load, idx) for d, n, load, idx in loads), "members of a DP rank differ"
    counts = [firsts[d][0] for d in range(dp_size)]
    assert len(set(counts)) == 1, counts
    heaviest = max(np.bincount(groups, weights=lengths)) if groups else 0
    tok = [firsts[d][1] for d in range(dp_size)]
    assert max(tok) - min(tok) <= heaviest, (tok, heaviest)
    every = sorted(i for d in range(dp_size) for i in firsts[d][2])
    assert every == list(range(n_groups * group_size)), "samples lost or duplicated"
    # A second move along the same route: only columns travel, merged by index.
    shard.merge(local.moved(route, samples=["index", "rank"], per_token=["values"], with_tokens=False))
    assert torch.equal(shard["values"], shard.mask * shard["index"][:, None].float())
    if rank == 0:
        print(json.dumps({"scenario": f"route_dp{dp_size}_g{group_size}", "counts": counts, "tokens": tok}),
              flush=True)


def idle_server_cpu(window_s: float = 1.0) -> None:
    """The root's server thread waiting with no request in sight (the workers still generating)
    must not spin a core: the root process's CPU time over `window_s` of its own sleep, while
    the workers sleep longer before their first request. A blocking Recv in the server thread
    busy-polls: it would use most of a core (on a loaded 2-core host still a quarter or more)."""
    server = PromptServer(comm, 8, requester=rank != 0)
    if rank == 0:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        time.sleep(window_s)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    else:
        time.sleep(window_s + 0.5)
        mine = [i for c in server.batches(2) for i in c.tolist()]
    server.close()
    if rank == 0:
        print(json.dumps({"scenario": "idle_server_cpu", "cpu_s": round(cpu, 4), "wall_s": round(wall, 4)}),
              flush=True)
    check_exact("idle_server_drained", [] if rank == 0 else mine, np.arange(8))


def idle_rebalance_cpu(window_s: float = 1.0) -> None:
    """Ranks that end generation early wait for the last one at the step's rebalance (its first
    collective): they must wait asleep, not in MPI's busy-poll (a blocking allgather uses a core
    for as long as it waits: on a shared node, the core the slow rank needs). Rank 0 is the slow
    one; every other rank reports its CPU time over its wait."""
    if rank == 0:
        time.sleep(window_s)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    rebalance(list(range(4)), comm)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    waits = comm.gather({"cpu_s": round(cpu, 4), "wall_s": round(wall, 4)}, root=0)
    if rank == 0:
        print(json.dumps({"scenario": "idle_rebalance_cpu", "waits": waits[1:]}), flush=True)


def main() -> None:
    run_dynamic("dynamic_37_by_4", 37, 4)  # batch size not dividing the dataset
    if size > 1:
        idle_server_cpu()
        idle_rebalance_cpu()
    run_dynamic("more_workers_than_batches", 3, 2)
    run_dynamic("empty_dataset", 0, 3)
    run_dynamic("no_prefetch_37_by_5", 37, 5, prefetch=False)
    shuffled = np.random.default_rng(0).permutation(np.repeat(np.arange(20), 2))  # duplicates in the set
    run_dynamic("shuffled_order_with_repeats", len(shuffled), 3, order=shuffled)
    # A stuck worker (rank 1) holds its first batch until the others ran out of work: it ends with
    # that batch and at most the one it asked for ahead (prefetch), the others with the rest.
    every = run_dynamic("stuck_worker", 60, 2, stuck_rank=1 if size > 1 else None)
    if rank == 0 and size > 1:
        counts = [len(p) for p in every]
        assert 2 <= counts[1] <= 2 * 2 and sum(counts) - counts[1] >= 60 - 2 * 2, f"per rank {counts}"

    # Only some ranks request (others would be TP peers): the server still drains completely.
    requester = rank % 2 == 0
    with PromptServer(comm, 25, requester=requester) as server:
        mine = [i for c in server.batches(4) for i in c.tolist()] if requester else []
    check_exact("half_requesters", mine, np.arange(25))

    # A requester that stops early (request in flight or not) says goodbye; close() must not hang,
    # and nothing is handed out twice.
    for prefetch in (True, False):
        with PromptServer(comm, 50) as server:
            it = server.batches(3, prefetch=prefetch)
            first = next(it, np.array([], dtype=np.int64)).tolist()
            it.close()
        firsts = comm.gather(first, root=0)
        if rank == 0:
            flat = [i for f in firsts for i in f]
            assert len(flat) == len(set(flat)) and set(flat) <= set(range(50)), firsts

    # prompt_wait spans through the real Tracer (one Zarr group per rank), one per request.
    from slurm_align.profiling.timers import Tracer
    from slurm_align.store.traces import read_traces

    run_dir = comm.bcast(tempfile.mkdtemp(prefix="sa-balance-") if rank == 0 else None, root=0)
    # Rank 0 opens the store first: concurrent creation of the traces.zarr root races (zarr
    # ContainsGroupError, reported to the store's owner).
    tracer = Tracer(run_dir, "actor", rank) if rank == 0 else None
    comm.Barrier()
    with tracer or Tracer(run_dir, "actor", rank) as tracer, PromptServer(comm, 30, tracer=tracer, step=3) as server:
        n_req = sum(1 for _ in server.batches(4)) + 1  # + the final "empty" answer
    comm.Barrier()
    if rank == 0:
        spans = read_traces(Path(run_dir) / "traces.zarr").spans
        per_rank = Counter(int(r) for r in spans["rank"][spans["phase"] == "prompt_wait"])
        assert set(spans["step"].tolist()) == {3}, spans
    counts = comm.bcast(per_rank if rank == 0 else None, root=0)
    assert counts[rank] == n_req, (rank, counts, n_req)
    if rank == 0:
        shutil.rmtree(run_dir)
        print(json.dumps({"scenario": "tracer_prompt_wait", "spans_per_rank": [counts[r] for r in range(size)]}))

    for strided in (False, True):
        src = StaticPrompts(23, rank, size, strided=strided)
        mine = [i for c in src.batches(4) for i in c.tolist()]
        every = check_exact(f"static_{'strided' if strided else 'contiguous'}", mine, np.arange(23))
        if rank == 0:
            assert max(map(len, every)) - min(map(len, every)) <= 1

    # Rebalance: uneven lists -> equal counts, every sample exactly once, payload intact.
    n_local = [3 * size + 1 if r == 0 else 1 for r in range(size)]
    n_local[-1] += (-sum(n_local)) % size  # make the total divisible
    mine = [{"id": (rank, i), "tokens": np.full(1 + (7 * i + rank) % 13, rank)} for i in range(n_local[rank])]
    out = rebalance(mine, comm)
    counts = comm.allgather(len(out))
    assert len(set(counts)) == 1, counts
    ids = comm.gather([s["id"] for s in out], root=0)
    assert all(np.all(s["tokens"] == s["id"][0]) for s in out)
    if rank == 0:
        flat = sorted(i for p in ids for i in p)
        assert flat == sorted((r, i) for r in range(size) for i in range(n_local[r])), "rebalance lost/duplicated"

    # Token-balanced, columnar dict of arrays.
    lens = np.array([1 + (31 * i + 7 * rank) % 50 for i in range(n_local[rank])], dtype=np.int64)
    cols = {"len": lens, "src": np.full(len(lens), rank), "pos": np.arange(len(lens))}
    out = rebalance(cols, comm, lengths=lens.tolist())
    counts = comm.allgather(len(out["len"]))
    loads = comm.allgather(int(out["len"].sum()))
    assert len(set(counts)) == 1, counts
    pairs = comm.gather(list(zip(out["src"].tolist(), out["pos"].tolist())), root=0)
    if rank == 0:
        flat = sorted(p for part in pairs for p in part)
        assert flat == sorted((r, i) for r in range(size) for i in range(n_local[r]))
        print(json.dumps({"scenario": "rebalance_tokens", "counts": counts, "loads": loads}), flush=True)

    # The actor's path: RolloutBatch moved along a Route to training DP ranks of dp_size ranks each.
    for dp_size in sorted({1, size, 2 if size % 2 == 0 else size}):
        run_route(dp_size, group_size=2)
        run_route(dp_size, group_size=1)

    # Not divisible: a clear error on every rank, nothing moved.
    if size > 1:
        try:
            rebalance(list(range(1 if rank == 0 else 2)), comm)
        except RebalanceError as exc:
            assert "divisible" in str(exc)
        else:
            raise AssertionError("indivisible rebalance did not raise")
    if rank == 0:
        print("BALANCE_OK", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
