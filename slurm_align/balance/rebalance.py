"""Global rollout rebalance: after dynamic generation, every training DP rank gets its share.

Two plans, one greedy core (longest-processing-time first, under an equal-count constraint, so
token loads come out even too):

- `plan_groups`: the actor's plan. Every rank knows every sample's (index, group, tokens) (a
  small allgather); groups are the unit (a GRPO group stays on one DP rank), and the plan is a
  pure function of those numbers, not of which rank generated what, so a run is reproducible
  whatever the dynamic prompt server did.
- `plan_rebalance`: per source rank, keeping samples where they are when that is as good (fewest
  moves); used by `rebalance`, the generic alltoall of picklable samples.

`Route` carries a plan out: one alltoall over the component's communicator, in which each sample
goes to every rank of its destination DP rank's model-parallel group (they all need the same
batch) and nowhere else. The same route can move further columns later (the critic's results).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from slurm_align.parallel import quiet


class RebalanceError(ValueError):
    """The rollouts cannot be split evenly over the DP ranks."""


def _lpt(weights: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray, num_ranks: int, capacity: int | None,
         home: Sequence[int] | None = None) -> np.ndarray:
    """Destination of each unit: heaviest first to the least-loaded rank with room (`capacity`
    samples per rank, None: unbounded); ties go to the unit's `home` if it is among the best,
    else to the lowest rank. Units are visited by (-weight, position): deterministic."""
    dest = np.full(len(weights), -1, dtype=np.int64)
    load, filled = np.zeros(num_ranks, dtype=np.int64), np.zeros(num_ranks, dtype=np.int64)
    for u in sorted(range(len(weights)), key=lambda u: (-int(weights[u]), u)):
        room = np.arange(num_ranks) if capacity is None else np.flatnonzero(filled + sizes[u] <= capacity)
        if not len(room):
            raise RebalanceError(
                f"a group of {sizes[u]} samples fits on no DP rank (each takes {capacity} samples, filled "
                f"{filled.tolist()}): the groups cannot be split evenly over {num_ranks} DP ranks; choose a "
                f"prompt count divisible by the data-parallel size {num_ranks}")
        best = room[load[room] == load[room].min()]
        d = int(home[u]) if home is not None and home[u] in best else int(best[0])
        dest[u] = d
        load[d] += int(weights[u])
        filled[d] += sizes[u]
    return dest


def _check_divisible(total: int, size: int, detail: str) -> int:
    if total % size:
        raise RebalanceError(
            f"{total} rollout samples cannot be split evenly over {size} DP ranks ({detail}); choose a "
            f"rollout count (ppo rollout batch size) divisible by the data-parallel size {size}")
    return total // size


def plan_groups(lengths: Sequence[int], groups: Sequence[int], num_ranks: int, *,
                equal_counts: bool = True) -> dict[int, int]:
    """Destination DP rank of every group: {group id: rank}. `lengths` and `groups` are per
    sample (token count, group id), in any order. With `equal_counts` every rank gets the same
    number of samples (an error when the groups do not allow it); tokens are balanced greedily."""
    tokens, group_ids = np.asarray(lengths, dtype=np.int64), np.asarray(groups, dtype=np.int64)
    ids, inverse = np.unique(group_ids, return_inverse=True)
    weight = np.bincount(inverse, weights=tokens, minlength=len(ids)).astype(np.int64)
    size = np.bincount(inverse, minlength=len(ids))
    capacity = _check_divisible(len(group_ids), num_ranks, f"{len(ids)} groups") if equal_counts else None
    dest = _lpt(weight, size, num_ranks, capacity)
    return dict(zip(ids.tolist(), dest.tolist()))


def plan_rebalance(counts: Sequence[int], lengths: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
    """Destination DP rank of every sample, per source rank: plan[src][i] = dest of sample i."""
    size = len(counts)
    target = _check_divisible(int(sum(counts)), size, f"per-rank counts {list(counts)}")
    plan = [np.full(c, -1, dtype=np.int64) for c in counts]
    if lengths is None:
        # Fewest moves: each rank keeps up to `target` of its own; the surplus fills the deficits.
        surplus = [(s, i) for s, c in enumerate(counts) for i in range(min(c, target), c)]
        for s, c in enumerate(counts):
            plan[s][: min(c, target)] = s
        deficits = [d for d, c in enumerate(counts) for _ in range(max(0, target - c))]
        for (s, i), d in zip(surplus, deficits):
            plan[s][i] = d
        return plan
    if [len(x) for x in lengths] != list(counts):
        raise RebalanceError(
            f"token lengths per rank {[len(x) for x in lengths]} do not match sample counts {list(counts)}")
    units = [(s, i) for s, ls in enumerate(lengths) for i in range(len(ls))]
    dest = _lpt([lengths[s][i] for s, i in units], [1] * len(units), size, target, home=[s for s, _ in units])
    for (s, i), d in zip(units, dest):
        plan[s][i] = d
    return plan


class Route:
    """A plan for this rank's local samples, and the alltoall that carries it out.

    `dest[i]` is the destination DP rank of local sample i; `members[d]` the ranks of `comm` that
    make up DP rank d (its whole TP x PP group: each of them receives the same part)."""

    def __init__(self, comm: Any, dest: np.ndarray, members: list[list[int]]):
        self.comm, self.dest, self.members = comm, dest, members
        self.dp_of = {r: d for d, ranks in enumerate(members) for r in ranks}

    @classmethod
    def plan(cls, comm: Any, dp_rank: int, dp_size: int, *, index: np.ndarray, groups: np.ndarray,
             lengths: np.ndarray, equal_counts: bool = True, expected: int | None = None) -> Route:
        """Collective over `comm`. Every rank passes its local samples' index (unique in the step),
        group id and token count (empty on ranks that hold none); only these travel to plan.
        `expected`: the step's sample count, checked (a lost or duplicated sample is an error)."""
        quiet.barrier(comm)   # ranks end generation at different times: the early ones wait asleep
        every = comm.allgather((int(dp_rank), np.asarray(index, np.int64), np.asarray(groups, np.int64),
                                np.asarray(lengths, np.int64)))
        all_index = np.concatenate([e[1] for e in every])
        if expected is not None and len(all_index) != expected:
            raise RebalanceError(f"the ranks hold {len(all_index)} rollout samples, expected {expected}: "
                                 f"a sample was lost or duplicated")
        if len(np.unique(all_index)) != len(all_index):
            raise RebalanceError(f"rollout indices are not unique over the ranks ({len(all_index)} samples, "
                                 f"{len(np.unique(all_index))} distinct): a sample was generated twice")
        to = plan_groups(np.concatenate([e[3] for e in every]), np.concatenate([e[2] for e in every]),
                         dp_size, equal_counts=equal_counts)
        members = [[r for r, e in enumerate(every) if e[0] == d] for d in range(dp_size)]
        dest = np.array([to[int(g)] for g in np.asarray(groups).tolist()], dtype=np.int64)
        return cls(comm, dest, members)

    def rows_for(self, d: int) -> np.ndarray:
        """Positions of the local samples bound for DP rank d."""
        return np.flatnonzero(self.dest == d)

    def exchange(self, parts: Sequence[Any]) -> list[Any]:
        """parts[d] goes to every member of DP rank d (collective); returns what every rank of
        `comm` sent here, in rank order."""
        if len(parts) != len(self.members):
            raise RebalanceError(f"got {len(parts)} parts for {len(self.members)} DP ranks")
        quiet.barrier(self.comm)   # e.g. after the log-probs, which end at different times on each rank
        return self.comm.alltoall([parts[self.dp_of[r]] for r in range(self.comm.Get_size())])


def _is_columnar(samples: Any) -> bool:
    return isinstance(samples, dict) and all(isinstance(v, np.ndarray) for v in samples.values())


def _num_samples(samples: Any) -> int:
    if not _is_columnar(samples):
        return len(samples)
    sizes = {k: v.shape[0] for k, v in samples.items()}
    if len(set(sizes.values())) > 1:
        raise RebalanceError(f"columnar rollout arrays disagree on the sample count (leading dim): {sizes}")
    return next(iter(sizes.values()), 0)


def rebalance(samples: Any, comm: Any, *, lengths: Sequence[int] | None = None) -> Any:
    """Redistribute samples over `comm` (mpi4py, the training DP group). Collective.

    `samples`: a list of picklable samples, or a dict of numpy arrays sharing the leading
    (sample) dimension. `lengths`: per-sample token counts to balance tokens as well (pass it on
    all ranks or none). Returns the same kind of container; samples ordered by (source rank,
    original position), so the result is deterministic.
    """
    columnar = _is_columnar(samples)
    n = _num_samples(samples)
    if lengths is not None and len(lengths) != n:
        raise RebalanceError(f"got {len(lengths)} token lengths for {n} samples on DP rank {comm.Get_rank()}")
    quiet.barrier(comm)   # the early ranks wait asleep, not in the allgather's busy-poll
    counts = comm.allgather(n)
    all_lengths = comm.allgather(list(map(int, lengths))) if lengths is not None else None
    size = comm.Get_size()
    route = Route(comm, plan_rebalance(counts, all_lengths)[comm.Get_rank()], [[r] for r in range(size)])
    if columnar:
        incoming = route.exchange([{k: v[route.rows_for(d)] for k, v in samples.items()} for d in range(size)])
        return {k: np.concatenate([part[k] for part in incoming]) for k in samples}
    return [x for part in route.exchange([[samples[i] for i in route.rows_for(d)] for d in range(size)])
            for x in part]
