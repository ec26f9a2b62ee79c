"""Prompt server, static sharding and rollout rebalance: pure plan checks + real MPI ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from slurm_align.balance.rebalance import RebalanceError, plan_groups, plan_rebalance
from slurm_align.balance.static import static_shard

REPO = Path(__file__).resolve().parents[2]


def mpirun(n: int, module: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, "-W", "ignore", "-m", module]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_prompt_server_and_rebalance_on_real_ranks(ranks: int) -> None:
    proc = mpirun(ranks, "tests.programs.balance_prog")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    seen = {x["scenario"]: x for x in lines}
    assert "BALANCE_OK" in proc.stdout
    # The program asserts the multisets itself; here: every scenario ran on every rank count.
    for name in ("dynamic_37_by_4", "more_workers_than_batches", "empty_dataset", "stuck_worker",
                 "no_prefetch_37_by_5", "tracer_prompt_wait",
                 "shuffled_order_with_repeats", "half_requesters", "static_contiguous", "static_strided"):
        assert len(seen[name].get("per_rank", seen[name].get("spans_per_rank"))) == ranks, name
    assert sum(seen["stuck_worker"]["per_rank"]) == 60
    if ranks > 1:
        # The root's server thread waits asleep while no worker asks (a blocking Recv spins:
        # measured 0.45-1.0 CPU-s per second of waiting on this 2-core host).
        idle = seen["idle_server_cpu"]
        assert idle["cpu_s"] < 0.1 * idle["wall_s"], f"the idle prompt server used {idle}"
        # ... and so do the ranks that wait for the slowest at the step's rebalance (a blocking
        # allgather spun there: 0.33 CPU-s per second of waiting with this host at load 13).
        for wait in seen["idle_rebalance_cpu"]["waits"]:
            assert wait["wall_s"] > 0.5 and wait["cpu_s"] < 0.1 * wait["wall_s"], seen["idle_rebalance_cpu"]
    assert len(set(seen["rebalance_tokens"]["counts"])) == 1
    # RolloutBatch along a Route (the program checks each rank's share against the plan, the
    # multiset of samples, payloads, and that every member of a DP rank got the same shard).
    for dp in {1, ranks, 2 if ranks % 2 == 0 else ranks}:
        for g in (1, 2):
            assert seen[f"route_dp{dp}_g{g}"]["counts"] == [6 * g] * dp


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("n,size", [(0, 3), (5, 8), (23, 4), (100, 7)])
def test_static_shards_partition_the_set(n: int, size: int, strided: bool) -> None:
    shards = [static_shard(n, r, size, strided=strided) for r in range(size)]
    assert Counter(i for s in shards for i in s.tolist()) == Counter(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    if not strided:
        assert all(np.all(np.diff(s) == 1) for s in shards if len(s) > 1)


def _check_plan(counts: list[int], plan: list[np.ndarray]) -> np.ndarray:
    size = len(counts)
    got = np.bincount(np.concatenate(plan).astype(int), minlength=size)
    assert got.tolist() == [sum(counts) // size] * size
    assert [len(p) for p in plan] == counts  # every sample has exactly one destination
    return got


def test_rebalance_plan_equal_counts_with_fewest_moves() -> None:
    counts = [7, 0, 3, 2]
    plan = plan_rebalance(counts)
    _check_plan(counts, plan)
    moved = sum(int((p != s).sum()) for s, p in enumerate(plan))
    assert moved == 4  # only rank 0's surplus moves


def test_rebalance_plan_balances_tokens() -> None:
    rng = np.random.default_rng(0)
    counts = [10, 2, 0, 4]
    lengths = [rng.lognormal(4, 1, c).astype(int).tolist() for c in counts]
    plan = plan_rebalance(counts, lengths)
    _check_plan(counts, plan)
    loads = np.zeros(4)
    for s, p in enumerate(plan):
        np.add.at(loads, p, lengths[s])
    # Plain (fewest-moves) assignment for comparison: LPT must be no worse on the max load.
    plain = np.zeros(4)
    for s, p in enumerate(plan_rebalance(counts)):
        np.add.at(plain, p, lengths[s])
    assert loads.max() <= plain.max()
    assert loads.max() - loads.min() <= max(max(x) for x in lengths if x)


def test_rebalance_indivisible_total_is_a_clear_error() -> None:
    with pytest.raises(RebalanceError, match=r"17 rollout samples .* 4 DP ranks.*divisible"):
        plan_rebalance([5, 4, 4, 4])


def test_group_plan_keeps_groups_together_with_equal_counts_and_balanced_tokens() -> None:
    rng = np.random.default_rng(1)
    groups = np.repeat(np.arange(12), 4)
    lengths = rng.integers(1, 200, size=len(groups))
    plan = plan_groups(lengths, groups, 3)
    assert set(plan) == set(range(12))
    counts = np.bincount([plan[g] for g in groups], minlength=3)
    assert counts.tolist() == [16, 16, 16]
    loads = np.bincount([plan[g] for g in groups], weights=lengths, minlength=3)
    assert loads.max() - loads.min() <= np.bincount(groups, weights=lengths).max()
    # Each sample its own group: the same plan as the per-source planner with one source.
    single = plan_groups(lengths, np.arange(len(lengths)), 4)
    assert [single[i] for i in range(len(lengths))] == plan_rebalance([len(lengths), 0, 0, 0],
                                                                       [lengths.tolist(), [], [], []])[0].tolist()


def test_groups_that_cannot_split_evenly_are_a_clear_error() -> None:
    with pytest.raises(RebalanceError, match="group of 2 samples fits on no DP rank"):
        plan_groups([5] * 6, [0, 0, 1, 1, 2, 2], 2)   # 3 groups of 2 over 2 ranks
    assert plan_groups([5] * 6, [0, 0, 1, 1, 2, 2], 2, equal_counts=False)


@pytest.mark.mpi
def test_evaluation_takes_its_prompts_from_the_work_stealing_server() -> None:
    """evaluate()'s batches (evaluation.prompt_batches) on 2 real ranks, rank 1 slow: the server
    gives the fast rank more of the 60 prompts; switches.dynamic_prompts off gives 30 each."""
    proc = mpirun(2, "tests.programs.eval_balance_prog")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {x["dynamic"]: x["per_rank"] for x in map(json.loads, (x for x in proc.stdout.splitlines()
                                                                  if x.startswith("{")))}
    assert got[False] == [30, 30]
    assert got[True][0] > got[True][1], f"the fast rank took {got[True]}"
