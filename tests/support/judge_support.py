"""The small judge of the sort task (examples/judge_tiny.yaml), trained by the project's SFT job
on the rule's verdicts of training pairs; its agreement with the rule on held-out pairs."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from slurm_align import REPO_ROOT

HELDOUT_SEED = 99   # the training pairs are drawn from seeds 11/12 (sort_pairs.write_judge_data)


def train_sort_judge(folder: Path) -> Path:
    """Train the judge into `folder` (its run directory: folder/run); its checkpoints folder."""
    from slurm_align.config import load_profile, load_run_config
    from slurm_align.judge.sort_pairs import write_judge_data
    from slurm_align.slurm.launch import launch_run

    write_judge_data(folder / "data")
    run = load_run_config(REPO_ROOT / "examples" / "judge_tiny.yaml", [
        f"data.train_path={folder / 'data' / 'judge_train.jsonl'}",
        f"data.val_path={folder / 'data' / 'judge_val.jsonl'}"])
    job = launch_run(run, load_profile("local"), folder / "run")
    state = job.wait(timeout_s=1800)
    assert state == "COMPLETED", f"the judge's SFT run ended {state}"
    return folder / "run" / "checkpoints" / "sft"


def agreement(checkpoint: Path | None, n: int = 1000) -> np.ndarray:
    """1 where the judge's pairwise verdict (both orders averaged) agrees with the rule, per
    held-out pair; `checkpoint` None: the judge's initial (untrained) weights."""
    from slurm_align.config import load_run_config
    from slurm_align.judge.client import LocalJudge, pairwise_probs
    from slurm_align.judge.model import JudgeModel
    from slurm_align.judge.prompts import JudgeTemplate
    from slurm_align.judge.sort_pairs import SORT_PRINCIPLE, rule_pair, rule_verdict
    from tests.support.single_rank import single_rank_world

    over = [] if checkpoint is None else [f"model.init_checkpoint={checkpoint}"]
    run = load_run_config(REPO_ROOT / "examples" / "judge_tiny.yaml", over)
    rng = random.Random(HELDOUT_SEED)
    pairs = [rule_pair(rng) for _ in range(n)]
    with single_rank_world() as (_env, pctx):
        judge = LocalJudge(JudgeModel.load(run.model, pctx, seed=run.seed))
        p = pairwise_probs(judge, JudgeTemplate.get("pairwise_compact"), [SORT_PRINCIPLE], pairs)
    return np.array([int((x > 0.5) == (rule_verdict(*q) == "A")) for x, q in zip(p, pairs)])
