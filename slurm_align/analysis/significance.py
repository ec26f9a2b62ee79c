"""Did a run really get better? Exact sign tests on paired per-prompt outcomes, and a rank-sum
test on rewards.

Two evaluations of the same held-out prompts (RUN_DIR/eval/step_<N>.jsonl, written by
slurm_align/algorithms/evaluation.py) pair prompt by prompt. Only the prompts whose outcome
changed carry evidence: b went wrong -> right, c right -> wrong. Were the two policies equally
good, each changed prompt would be b or c with probability 1/2, so the one-sided p-value of
"after is better than before" is P(Binomial(b + c, 1/2) >= b): the exact McNemar (sign) test.
It needs no assumption about how hard the prompts are, and its inputs are integer counts.

    before = pooled_correct(run_dir, [0])
    after = pooled_correct(run_dir, [40, 50, 60])      # correct in most of the last evaluations
    counts = paired_counts(before, after)
    counts.b, counts.c, counts.p_better                 # e.g. 310, 95, 1.2e-27

One evaluation of a policy still varies with the float path that produced it (the policy's
trajectory differs in its last bits between CPU kernels); pooling the last few evaluations of a
run (`pooled_correct`: correct in more than half of them) keeps one lucky or unlucky checkpoint
from deciding.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_align.rundir import RunDir

MIN_RANK_SUM_SAMPLES = 20
"""rank_sum_test's normal approximation is used from this many values per side."""


def sign_test(b: int, c: int) -> float:
    """One-sided exact sign test: P(X >= b) for X ~ Binomial(b + c, 1/2). 1.0 when b + c == 0
    (nothing changed: no evidence either way). The tail is summed in integers and divided once
    (Python rounds int / int correctly), so it is exact to the float's last bit at any count."""
    if b < 0 or c < 0 or int(b) != b or int(c) != c:
        raise ValueError(f"sign_test needs counts (integers >= 0), got b={b!r}, c={c!r}")
    b, c = int(b), int(c)
    n = b + c
    return sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n if n else 1.0


@dataclass(frozen=True)
class PairedCounts:
    """Two outcomes of the same prompts, as counts: b wrong -> right, c right -> wrong."""

    n: int                  # prompts
    before: int             # correct before
    after: int              # correct after
    b: int                  # wrong before, right after
    c: int                  # right before, wrong after

    @property
    def acc_before(self) -> float:
        return self.before / self.n

    @property
    def acc_after(self) -> float:
        return self.after / self.n

    @property
    def p_better(self) -> float:
        """One-sided p-value of "after is better than before" (small: it is)."""
        return sign_test(self.b, self.c)

    @property
    def p_worse(self) -> float:
        """One-sided p-value of "after is worse than before"."""
        return sign_test(self.c, self.b)

    def __str__(self) -> str:
        return (f"{self.acc_before:.3f} -> {self.acc_after:.3f} on {self.n} prompts: b={self.b} wrong->right, "
                f"c={self.c} right->wrong, p(better)={self.p_better:.2e}, p(worse)={self.p_worse:.2e}")


def paired_counts(before: Sequence[int] | np.ndarray, after: Sequence[int] | np.ndarray) -> PairedCounts:
    """Counts of two 0/1 outcome vectors of the same prompts (same order)."""
    x, y = np.asarray(before), np.asarray(after)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"paired outcomes need the same prompts: {x.shape} before, {y.shape} after")
    if not (np.isin(x, (0, 1)).all() and np.isin(y, (0, 1)).all()):
        raise ValueError("paired outcomes are 0 (wrong) or 1 (correct)")
    return PairedCounts(n=len(x), before=int(x.sum()), after=int(y.sum()), b=int(((x == 0) & (y == 1)).sum()),
                        c=int(((x == 1) & (y == 0)).sum()))


def read_results(run_dir: str | Path, step: int) -> list[dict]:
    """The per-prompt rows of the evaluation after `step` (RUN_DIR/eval/step_<step>.jsonl)."""
    rd = RunDir(Path(run_dir))
    path = rd.eval_results(step)
    if not path.is_file():
        have = rd.eval_steps()
        raise FileNotFoundError(f"{path}: no evaluation after step {step} (this run has {have or 'none'}; "
                                f"eval.interval sets when a run evaluates)")
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def pooled_correct(run_dir: str | Path, steps: Sequence[int]) -> np.ndarray:
    """Per prompt, 1 where it was correct in most of the evaluations after `steps` (one step:
    that evaluation's outcome). An odd number of them: with an even one a tie would have to count
    one way, and the pooled accuracy would sit below (or above) every evaluation pooled. Every
    evaluation must be of the same prompts."""
    if len(steps) % 2 == 0:
        raise ValueError(f"pooled_correct pools an odd number of evaluations (a majority), got steps {list(steps)}")
    outcomes, prompts = [], None
    for step in steps:
        rows = read_results(run_dir, step)
        these = [r["prompt"] for r in rows]
        if prompts is not None and these != prompts:
            raise ValueError(f"{RunDir(Path(run_dir)).eval_results(step)}: other prompts than step {steps[0]}'s")
        prompts = these
        outcomes.append([int(r["correct"]) for r in rows])
    return (2 * np.sum(outcomes, axis=0) > len(steps)).astype(np.int64)


def same_prompts(run_a: str | Path, step_a: int, run_b: str | Path, step_b: int) -> bool:
    """Whether two evaluations (of two runs, say) scored the same prompts in the same order."""
    return [r["prompt"] for r in read_results(run_a, step_a)] == [r["prompt"] for r in read_results(run_b, step_b)]


@dataclass(frozen=True)
class RankSum:
    """Two samples of a continuous quantity (rewards of an early and a late window of steps)."""

    n_early: int
    n_late: int
    u2: int                 # 2 x Mann-Whitney U: pairs (early, late) with late > early count 2, ties 1
    p_higher: float         # one-sided p-value of "late is higher than early"
    mean_early: float
    mean_late: float

    def __str__(self) -> str:
        return (f"mean {self.mean_early:+.3f} -> {self.mean_late:+.3f} ({self.n_early} and {self.n_late} values): "
                f"2U={self.u2} of {2 * self.n_early * self.n_late}, p(higher)={self.p_higher:.2e}")


def rank_sum_test(early: Sequence[float], late: Sequence[float]) -> RankSum:
    """One-sided Mann-Whitney (Wilcoxon rank-sum) test of "late values are higher than early
    ones", for rewards, which are not paired (each step draws other prompts). U counts the pairs
    (early, late) with late > early, ties half; the p-value is the normal approximation with the
    tie and continuity corrections, close to exact from MIN_RANK_SUM_SAMPLES values per side."""
    x, y = np.asarray(early, np.float64), np.asarray(late, np.float64)
    if min(len(x), len(y)) < MIN_RANK_SUM_SAMPLES:
        raise ValueError(f"rank_sum_test needs at least {MIN_RANK_SUM_SAMPLES} values per side "
                         f"(its normal approximation), got {len(x)} and {len(y)}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("rank_sum_test: values must be finite")
    u2 = int(2 * (y[:, None] > x[None, :]).sum() + (y[:, None] == x[None, :]).sum())
    n1, n2 = len(x), len(y)
    n = n1 + n2
    _, ties = np.unique(np.concatenate([x, y]), return_counts=True)
    var = n1 * n2 / 12 * ((n + 1) - float((ties ** 3 - ties).sum()) / (n * (n - 1)))
    if var == 0:   # every value equal: nothing moved
        p = 1.0
    else:
        z = (u2 / 2 - n1 * n2 / 2 - 0.5) / math.sqrt(var)
        p = 0.5 * math.erfc(z / math.sqrt(2))
    return RankSum(n1, n2, u2, p, float(x.mean()), float(y.mean()))
