"""Prompt balancing: static vs dynamic (work-stealing) makespan vs ideal, server vs raw MPI rate,
and rank 0's CPU while the server waits idle against a thread in a blocking Recv.

    python benchmarks/bench_balance.py [--prompts 1024] [--ms-per-token 0.1] [--seed 0]

Starts its own 4 MPI ranks (re-executes itself under mpirun). Per-prompt work is a sleep
proportional to a seeded long-tailed response length (lognormal, plus a few 10x outliers), so
the makespans measure the distribution of work and not contention for this machine's 2 cores.
Everything is measured side by side in one run; the last line holds the figures as key=value.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RANKS = 4
REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--ms-per-token", type=float, default=0.1, help="simulated generation time per token")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per server request (dynamic)")
    p.add_argument("--round-s", type=float, default=0.3, help="seconds per rate measurement")
    p.add_argument("--rounds", type=int, default=9, help="interleaved raw/server rounds (rate test)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def response_lengths(n: int, seed: int) -> np.ndarray:
    """Tokens per response: lognormal around 64 tokens, 1% of prompts 10x longer."""
    rng = np.random.default_rng(seed)
    tokens = 64 * rng.lognormal(0.0, 0.5, n)
    outliers = rng.choice(n, max(1, n // 100), replace=False)
    tokens[outliers] *= 10
    return np.maximum(1, tokens.round()).astype(np.int64)


def makespan(comm, work_s: np.ndarray, batches) -> float:
    """Seconds from a common start until the last rank finished its share.

    Each rank sleeps until a deadline that advances by each batch's work plus the time it was
    blocked fetching the batch: sleep overshoot on a loaded machine does not pile up, while
    every wait on the prompt server (or imbalance between ranks) counts in full.
    """
    comm.Barrier()
    t0 = time.perf_counter()
    due, it = t0, iter(batches)
    while True:
        t = time.perf_counter()
        chunk = next(it, None)
        waited = time.perf_counter() - t
        if chunk is None:
            break
        due += waited + float(work_s[chunk].sum())
        time.sleep(max(0.0, due - time.perf_counter()))
    return comm.allreduce(time.perf_counter() - t0, op=max_op())


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def raw_pingpong_rate(comm, seconds: float) -> float:
    """Round trips per second: clients 1..N-1 do blocking int64 ping-pongs with rank 0 for a
    fixed time, then send a stop (-1)."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(1, dtype=np.int64)
    comm.Barrier()
    t0 = time.perf_counter()
    count, elapsed = 0, 0.0
    if rank == 0:
        status, stopped = MPI.Status(), 0
        while stopped < size - 1:
            comm.Recv([buf, MPI.INT64_T], MPI.ANY_SOURCE, 1, status)
            if buf[0] < 0:
                stopped += 1
            else:
                comm.Send([buf, MPI.INT64_T], status.Get_source(), 2)
    else:
        while time.perf_counter() - t0 < seconds:
            comm.Send([buf, MPI.INT64_T], 0, 1)
            comm.Recv([buf, MPI.INT64_T], 0, 2)
            count += 1
        elapsed = time.perf_counter() - t0
        comm.Send([np.full(1, -1, dtype=np.int64), MPI.INT64_T], 0, 1)
    return comm.allreduce(count) / comm.allreduce(elapsed, op=MPI.MAX)


def server_rate(comm, seconds: float, prefetch: bool) -> float:
    """Requests per second the prompt server answers (batch size 1) to the same client ranks,
    for a fixed time (then each client says goodbye). prefetch=False keeps one request in
    flight per client: the same pattern as the ping-pong."""
    from mpi4py import MPI

    from slurm_align.balance.prompts import PromptServer

    rank = comm.Get_rank()
    server = PromptServer(comm, 1_000_000, requester=rank != 0)
    comm.Barrier()
    t0 = time.perf_counter()
    count, elapsed = 0, 0.0
    if rank != 0:
        it = server.batches(1, prefetch=prefetch)
        for _ in it:
            count += 1
            if time.perf_counter() - t0 >= seconds:
                break
        elapsed = time.perf_counter() - t0
        it.close()
    server.close()
    return comm.allreduce(count) / comm.allreduce(elapsed, op=MPI.MAX)


def idle_cpu(comm, seconds: float, server: bool) -> float:
    """CPU seconds per second that rank 0 spends while its receiving thread waits with nothing to
    receive (the workers still generating): the prompt server's thread (server=True) or a thread
    in a plain blocking Recv (the server's old wait). Rank 0's main thread sleeps meanwhile."""
    import threading

    from mpi4py import MPI

    from slurm_align.balance.prompts import PromptServer

    rank = comm.Get_rank()
    buf = np.zeros(1, dtype=np.int64)
    if server:
        srv = PromptServer(comm, 1, requester=rank != 0)
    elif rank == 0:
        thread = threading.Thread(target=comm.Recv, args=([buf, MPI.INT64_T], MPI.ANY_SOURCE, 9))
        thread.start()
    comm.Barrier()
    used = 0.0
    if rank == 0:
        cpu0 = time.process_time()
        time.sleep(seconds)
        used = (time.process_time() - cpu0) / seconds
    else:
        time.sleep(seconds + 0.2)
    if server:
        if rank != 0:
            for _ in srv.batches(1):
                pass
        srv.close()
    else:
        if rank == 1:
            comm.Send([buf, MPI.INT64_T], 0, 9)
        if rank == 0:
            thread.join()
        comm.Barrier()
    return used


def child(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from slurm_align.balance.prompts import PromptServer
    from slurm_align.balance.static import StaticPrompts

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    tokens = response_lengths(args.prompts, args.seed)
    work_s = tokens * args.ms_per_token / 1e3
    ideal = float(work_s.sum()) / size
    say(f"{args.prompts} prompts, {tokens.sum()} tokens (max {tokens.max()}, median {int(np.median(tokens))}), "
        f"{size} ranks, ideal makespan {ideal:.3f} s")

    static = makespan(comm, work_s, StaticPrompts(args.prompts, rank, size).batches(args.batch_size))
    say(f"static  (contiguous shards): {static:.3f} s")
    with PromptServer(comm, args.prompts) as server:
        dynamic = makespan(comm, work_s, server.batches(args.batch_size))
        waits = comm.gather(sum(server.wait_times), root=0)
    say(f"dynamic (work stealing, batch {args.batch_size}): {dynamic:.3f} s; "
        f"prompt_wait per rank {[round(w * 1e3, 1) for w in waits or []]} ms")

    # Interleaved rounds, ratio taken within each round: the machine is shared, so its load
    # drifts; the median of paired ratios is robust to that drift.
    raw, srv, pre = [], [], []
    for _ in range(args.rounds):
        raw.append(raw_pingpong_rate(comm, args.round_s))
        srv.append(server_rate(comm, args.round_s, prefetch=False))
        pre.append(server_rate(comm, args.round_s, prefetch=True))
    ratio = float(np.median(np.array(srv) / np.array(raw)))
    # Rank 0's CPU while its receiving thread waits idle: the server against a blocking Recv.
    idle_recv, idle_srv = [], []
    for _ in range(3):
        idle_recv.append(idle_cpu(comm, 1.0, server=False))
        idle_srv.append(idle_cpu(comm, 1.0, server=True))
    say(f"rank 0 CPU-s per s while idle: blocking Recv {[round(x, 3) for x in idle_recv]}, "
        f"prompt server {[round(x, 3) for x in idle_srv]}")
    say(f"raw MPI ping-pong: {[round(r) for r in raw]} round trips/s")
    say(f"prompt server: {[round(s) for s in srv]} requests/s (one in flight), {[round(s) for s in pre]} (prefetch)")
    if rank == 0:
        figures = {
            "ranks": size,
            "prompts": args.prompts,
            "ideal_s": round(ideal, 4),
            "static_s": round(static, 4),
            "dynamic_s": round(dynamic, 4),
            "dynamic_over_ideal": round(dynamic / ideal, 4),
            "static_over_ideal": round(static / ideal, 4),
            "server_req_per_s": round(float(np.median(srv))),
            "raw_roundtrips_per_s": round(float(np.median(raw))),
            "server_prefetch_req_per_s": round(float(np.median(pre))),
            "server_over_raw": round(ratio, 4),
            "idle_cpu_per_s_blocking_recv": round(float(np.median(idle_recv)), 4),
            "idle_cpu_per_s_server": round(float(np.median(idle_srv)), 4),
        }
        print(" ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def main() -> int:
    args = parse()
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ:
        child(args)
        return 0
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = ["mpirun", "--oversubscribe", "-n", str(RANKS), sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    return subprocess.run(cmd, env=env, timeout=300).returncode


if __name__ == "__main__":
    sys.exit(main())
