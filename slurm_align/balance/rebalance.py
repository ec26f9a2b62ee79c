"""Global rollout rebalance: after dynamic generation, every DP rank gets the same sample count.

PPO trains on a fixed rollout count that DP must divide, so a total that does not divide is an
error (nothing is padded or dropped). With per-sample token counts the assignment is greedy
longest-processing-time under the equal-count constraint, so token loads come out even too.
The plan is a pure function of the allgathered counts/lengths, computed identically everywhere;
the samples move with one alltoall of pickles over the DP communicator.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class RebalanceError(ValueError):
    """The rollouts cannot be split evenly over the DP ranks."""


def plan_rebalance(counts: Sequence[int], lengths: Sequence[Sequence[int]] | None = None) -> list[np.ndarray]:
    """Destination DP rank of every sample, per source rank: plan[src][i] = dest of sample i."""
    size, total = len(counts), int(sum(counts))
    if total % size:
        raise RebalanceError(
            f"{total} rollout samples cannot be split evenly over {size} DP ranks "
            f"(per-rank counts {list(counts)}); choose a rollout count (ppo rollout batch size) "
            f"divisible by the data-parallel size {size}"
        )
    target = total // size
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
        raise RebalanceError(f"token lengths per rank {[len(x) for x in lengths]} do not match sample counts {list(counts)}")
    items = sorted(((int(n), s, i) for s, ls in enumerate(lengths) for i, n in enumerate(ls)), key=lambda t: (-t[0], t[1], t[2]))
    load, filled = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
    for n, s, i in items:
        open_ranks = np.flatnonzero(filled < target)
        best = open_ranks[load[open_ranks] == load[open_ranks].min()]
        d = s if s in best else int(best[0])  # on ties keep the sample where it is
        plan[s][i] = d
        load[d] += n
        filled[d] += 1
    return plan


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
    counts = comm.allgather(n)
    all_lengths = comm.allgather(list(map(int, lengths))) if lengths is not None else None
    dest = plan_rebalance(counts, all_lengths)[comm.Get_rank()]
    size = comm.Get_size()
    if columnar:
        outgoing = [{k: v[dest == d] for k, v in samples.items()} for d in range(size)]
        incoming = comm.alltoall(outgoing)
        keys = list(samples.keys())
        return {k: np.concatenate([part[k] for part in incoming]) for k in keys}
    outgoing = [[] for _ in range(size)]
    for sample, d in zip(samples, dest):
        outgoing[d].append(sample)
    return [x for part in comm.alltoall(outgoing) for x in part]
