"""The learning tests' verdict, decided with statistical power instead of a margin tuned to one
trajectory: "the algorithm learns the task; its broken twin does not".

A learning run evaluates the held-out set (2,000 sort prompts, examples/synthetic/prompts_val.jsonl)
at step 0 and at its last evaluations; each evaluation's per-prompt outcome is in
RUN_DIR/eval/step_<N>.jsonl (slurm_align/algorithms/evaluation.py). The run's end point is pooled
over its last POOLED evaluations (a prompt counts as solved where it was solved in most of them),
so one lucky or unlucky checkpoint does not decide. Three paired comparisons on the same prompts,
each an exact one-sided sign test on the prompts that changed (b wrong -> right, c right -> wrong;
slurm_align.analysis.significance):
  (a) the run's end beats its start:           p(better) < ALPHA
  (b) the run's end beats the broken twin's end: p(better) < ALPHA
  (c) the twin's end does not beat its start:   p(better) > TWIN_ALPHA
Another CPU's float path (AVX2 against AVX-512 kernels in ATen and MKL) changes a run's
trajectory, and so its exact scores, but must not change these verdicts:
benchmarks/learning_spread.py runs every learning test under several float paths and reports each
verdict's counts and p-values.

PPO's claim is about its reward (the reward model it optimises can be pleased without sorting):
`reward_verdict` compares the per-sample rewards of an early and a late window of steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from slurm_align.analysis.significance import (
    PairedCounts,
    RankSum,
    paired_counts,
    pooled_correct,
    rank_sum_test,
    read_results,
    same_prompts,
)
from slurm_align.rewards import sort
from slurm_align.rundir import RunDir
from slurm_align.store.rollouts import RolloutStore

ALPHA = 1e-3
"""A learning test's chance of calling a run that did not learn a learner (per comparison)."""
TWIN_ALPHA = 0.05
"""The broken twin fails the test when its own gain is significant at this level."""
POOLED = 3
"""Evaluations pooled into a run's end point (its last ones)."""
VERDICT_PREFIX = "learning-verdict "
"""Start of the one line of JSON each learning test prints (benchmarks/learning_spread.py reads it)."""


def end_steps(run_dir: Path, pooled: int = POOLED) -> list[int]:
    """The run's last `pooled` evaluated steps (after step 0)."""
    steps = [s for s in RunDir(run_dir).eval_steps() if s > 0]
    assert len(steps) >= pooled, f"{run_dir}: {pooled} evaluations after step 0 needed, found steps {steps}"
    return steps[-pooled:]


def check_eval_files(run_dir: Path) -> None:
    """Every val/score in metrics.jsonl is the mean score of its step's per-prompt file, every
    row's score is the sort task's exact score of its own response and prompt (rows whose scores
    were shuffled against their prompts would keep the mean), and every file scores the same
    prompts (a file of another step or of a part of the set would not)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = {m["step"]: m["val/score"] for m in records if "val/score" in m}
    assert sorted(scores) == RunDir(run_dir).eval_steps(), (sorted(scores), RunDir(run_dir).eval_steps())
    for step, score in scores.items():
        rows = read_results(run_dir, step)
        assert [r["index"] for r in rows] == list(range(len(rows)))
        assert abs(np.mean([r["score"] for r in rows]) - score) < 1e-9, (step, score)
        assert all(r["correct"] == int(r["score"] >= 1.0) for r in rows)
        wrong = [r for r in rows if sort.exact(r["response"], r["prompt"]) != r["score"]]
        assert not wrong, f"{run_dir} step {step}: {len(wrong)} rows whose score is not their response's: {wrong[:3]}"
        assert same_prompts(run_dir, step, run_dir, 0)


@dataclass(frozen=True)
class Verdict:
    """A learning test's three comparisons, as counts."""

    name: str
    gain: PairedCounts          # (a) the run: start -> pooled end
    over_twin: PairedCounts     # (b) the twin's pooled end -> the run's pooled end
    twin: PairedCounts          # (c) the twin: start -> pooled end
    end: list[int]              # the run's pooled steps
    twin_end: list[int]         # the twin's
    versus: PairedCounts | None = None   # another run's pooled end -> this run's (the async example's grpo_tiny)

    def record(self) -> dict:
        """What benchmarks/learning_spread.py tabulates (one JSON line)."""
        def counts(c: PairedCounts) -> dict:
            return {"n": c.n, "acc_before": c.acc_before, "acc_after": c.acc_after, "b": c.b, "c": c.c,
                    "p_better": c.p_better}
        return {"test": self.name, "alpha": ALPHA, "twin_alpha": TWIN_ALPHA, "end_steps": self.end,
                "twin_end_steps": self.twin_end, "gain": counts(self.gain), "over_twin": counts(self.over_twin),
                "twin": counts(self.twin), "versus": counts(self.versus) if self.versus else None}

    def __str__(self) -> str:
        return (f"{self.name} (end pooled over steps {self.end}, twin's over {self.twin_end}):\n"
                f"  (a) start -> end:       {self.gain}\n"
                f"  (b) twin end -> end:    {self.over_twin}\n"
                f"  (c) twin start -> end:  {self.twin}"
                + (f"\n  other run's end -> end: {self.versus}" if self.versus else ""))

    def check(self) -> None:
        print(VERDICT_PREFIX + json.dumps(self.record()))
        assert self.gain.p_better < ALPHA, f"{self.name} did not raise held-out exact accuracy at p < {ALPHA}:\n{self}"
        assert self.over_twin.p_better < ALPHA, \
            f"{self.name} did not end above its broken twin at p < {ALPHA}:\n{self}"
        assert self.twin.p_better > TWIN_ALPHA, \
            f"{self.name}'s broken twin raised held-out accuracy (p <= {TWIN_ALPHA}): the twin learns:\n{self}"


def verdict(name: str, run_dir: Path, twin_dir: Path) -> Verdict:
    """The three comparisons of a run and its broken twin (both from the same initial policy,
    evaluated on the same held-out prompts)."""
    for d in (run_dir, twin_dir):
        check_eval_files(d)
    assert same_prompts(run_dir, 0, twin_dir, 0), "the run and its twin were evaluated on other prompts"
    end, twin_end = end_steps(run_dir), end_steps(twin_dir)
    start, pooled = pooled_correct(run_dir, [0]), pooled_correct(run_dir, end)
    twin_start, twin_pooled = pooled_correct(twin_dir, [0]), pooled_correct(twin_dir, twin_end)
    return Verdict(name, gain=paired_counts(start, pooled), over_twin=paired_counts(twin_pooled, pooled),
                   twin=paired_counts(twin_start, twin_pooled), end=end, twin_end=twin_end)


# --- rewards (PPO) ------------------------------------------------------------------------------
def step_rewards(run_dir: Path, steps: range) -> np.ndarray:
    """The stored per-sample rewards of `steps`, concatenated."""
    store = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    have = store.steps.tolist()
    assert set(steps) <= set(have), f"{run_dir}: steps {list(steps)} wanted, the store has {have}"
    return np.concatenate([np.asarray(store.read(s)["reward"], np.float64) for s in steps])


@dataclass(frozen=True)
class RewardVerdict:
    """A reward-raising claim: per-sample rewards of the first and last WINDOW steps."""

    name: str
    gain: RankSum               # (a) the run: early -> late window
    over_twin: RankSum          # (b) the twin's late window -> the run's late window
    twin: RankSum               # (c) the twin: early -> late window

    def record(self) -> dict:
        def part(r: RankSum) -> dict:
            return {"mean_before": r.mean_early, "mean_after": r.mean_late, "u2": r.u2,
                    "pairs2": 2 * r.n_early * r.n_late, "p_better": r.p_higher}
        return {"test": self.name, "alpha": ALPHA, "twin_alpha": TWIN_ALPHA, "gain": part(self.gain),
                "over_twin": part(self.over_twin), "twin": part(self.twin)}

    def __str__(self) -> str:
        return (f"{self.name} (per-sample rewards, one-sided rank-sum tests):\n"
                f"  (a) early -> late:        {self.gain}\n"
                f"  (b) twin late -> late:    {self.over_twin}\n"
                f"  (c) twin early -> late:   {self.twin}")

    def check(self) -> None:
        print(VERDICT_PREFIX + json.dumps(self.record()))
        assert self.gain.p_higher < ALPHA, f"{self.name} did not raise its reward at p < {ALPHA}:\n{self}"
        assert self.over_twin.p_higher < ALPHA, \
            f"{self.name} did not end above its broken twin at p < {ALPHA}:\n{self}"
        assert self.twin.p_higher > TWIN_ALPHA, \
            f"{self.name}'s broken twin raised its reward (p <= {TWIN_ALPHA}): the twin learns:\n{self}"


def reward_verdict(name: str, run_dir: Path, steps: int, window: int, twin_dir: Path, twin_steps: int,
                   twin_window: int) -> RewardVerdict:
    """The run's first and last `window` steps, the twin's first and last `twin_window` (a twin
    of `twin_steps` steps)."""
    early = step_rewards(run_dir, range(1, window + 1))
    late = step_rewards(run_dir, range(steps - window + 1, steps + 1))
    twin_early = step_rewards(twin_dir, range(1, twin_window + 1))
    twin_late = step_rewards(twin_dir, range(twin_steps - twin_window + 1, twin_steps + 1))
    return RewardVerdict(name, gain=rank_sum_test(early, late), over_twin=rank_sum_test(twin_late, late),
                         twin=rank_sum_test(twin_early, twin_late))
