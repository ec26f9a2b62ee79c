"""PPO with a regression (multi-attribute) reward model as its reward: the critic serves the RM's
attributes weighted by reward.attribute_weights (here correctness only), the actor starts from
the session's SFT policy (`sft_checkpoint`), and the held-out exact-sort accuracy of greedy
answers to the 2,000 held-out prompts (the task's own rule, not the RM) is the verdict, with the
learning tests' statistics (tests/support/learning.py: exact sign tests on the prompts that
changed, the run's end pooled over its last evaluations). The broken twin is the same run with
the correctness weight negated (it is paid for wrong answers).

The regression RM is trained here (examples/rm_tiny.yaml with loss 'regression', 2 labels) on
HelpSteer2-format rows built from the task's preference pairs (slurm_align/data/helpsteer.py).

Minutes of reward-model and PPO training: opt-in with SLURM_ALIGN_REGRESSION_PPO=1.

Measured (this host, loaded; the test as written, twice with the same numbers): it does NOT hold,
so it is marked xfail(strict): the RM's correctness attribute is too weak to drive PPO on this
task. The RM (300 steps) reaches held-out val MSE 1.03 on correctness (labels 0 or 4), 0.10 on
verbosity. PPO raises the reward it optimises (the RM's correctness: mean 2.75 over steps 1-5,
3.71 over steps 26-30) while held-out exact accuracy falls from 0.268 to 0.011 (pooled end; 10
prompts wrong -> right, 523 right -> wrong) and answers shorten (6.4 characters at
step 0, 3.8 to 4.8 over steps 20-30): the
RM is gamed, as the Bradley-Terry RM is without the task's rule reward (tests/integration/
test_ppo.py: -0.234). The twin (weight -1) falls to 0.000 (answers of 1 character).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.data.helpsteer import ATTRIBUTES, helpsteer_rows
from slurm_align.models.checkpoint import find_latest
from tests.integration.test_ppo import launch_learning
from tests.support import learning
from tests.support.trainer_runs import make_run, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("SLURM_ALIGN_REGRESSION_PPO") != "1",
    reason="minutes of regression reward-model and PPO training: set SLURM_ALIGN_REGRESSION_PPO=1")]

SYNTH = REPO_ROOT / "examples" / "synthetic"
RM_STEPS = int(os.environ.get("SLURM_ALIGN_REGRESSION_RM_STEPS", "300"))
PPO_STEPS = int(os.environ.get("SLURM_ALIGN_REGRESSION_PPO_STEPS", "30"))
EVAL_INTERVAL = 5
"""Evaluations at 0, 5, ...: the run's end is pooled over its last three (learning.POOLED)."""
WEIGHTS = "[1.0,0.0]"
"""reward = 1.0 x correctness + 0.0 x verbosity (ATTRIBUTES' order)."""
TWIN_WEIGHTS = "[-1.0,0.0]"


@pytest.fixture(scope="module")
def regression_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The regression RM (correctness, verbosity) on the task's chosen and rejected answers."""
    folder = tmp_path_factory.mktemp("regression_rm")
    data = {split: helpsteer_rows(SYNTH / f"pref_{split}.jsonl", folder / f"helpsteer_{split}.jsonl",
                                  lambda pair: [pair["chosen"], pair["rejected"]]) for split in ("train", "val")}
    run_dir = make_run(folder / "run", "rm_tiny.yaml", [
        f"data.train_path={data['train']}", f"data.val_path={data['val']}", "actor.data_parallel=1",
        "model.num_labels=2", "loss.name=regression", f"loss.options.attributes=[{','.join(ATTRIBUTES)}]",
        f"trainer.num_steps={RM_STEPS}", "trainer.lr=3.0e-3", "trainer.save_interval=0"])
    train(run_dir, timeout=1800)
    latest = find_latest(run_dir / "checkpoints" / "rm")
    assert latest is not None, f"{run_dir}: no checkpoint"
    return latest


def ppo_run(sft: Path, rm: Path, weights: str) -> list[str]:
    return [f"model.init_checkpoint={sft}", f"critic_model.init_checkpoint={rm}", "critic_model.num_labels=2",
            f"reward.attribute_weights={weights}", f"ppo.num_steps={PPO_STEPS}", "ppo.kl_coef=0.05",
            "switches.dynamic_prompts=false", "ppo.num_rollout_samples=32", "generation.max_new_tokens=12",
            "generation.prompt_batch_size=4", "ppo.train_micro_batch_size=8", "ppo.actor_lr=1e-3",
            f"eval.val_path={SYNTH / 'prompts_val.jsonl'}", "eval.scorer=slurm_align.rewards.sort:exact",
            f"eval.interval={EVAL_INTERVAL}"]


@pytest.mark.timeout(3600)
@pytest.mark.xfail(strict=True, reason="measured: PPO games the regression RM's correctness attribute and held-out "
                   "exact accuracy falls 0.268 -> 0.011 (module docstring)")
def test_ppo_on_the_regression_rms_weighted_attributes_raises_held_out_accuracy(
        tmp_path: Path, sft_checkpoint: Path, regression_rm: Path):
    good = launch_learning(tmp_path / "good", ppo_run(sft_checkpoint, regression_rm, WEIGHTS))
    twin = launch_learning(tmp_path / "twin", ppo_run(sft_checkpoint, regression_rm, TWIN_WEIGHTS))
    verdict = learning.verdict("regression_ppo", good, twin)
    window = range(1, 1 + EVAL_INTERVAL), range(PPO_STEPS - EVAL_INTERVAL + 1, PPO_STEPS + 1)
    for name, run_dir in (("run", good), ("twin", twin)):   # what PPO optimised: the RM's weighted attributes
        first, last = (learning.step_rewards(run_dir, w).mean() for w in window)
        print(f"{name}: mean reward of steps {list(window[0])}: {first:.3f}, of steps {list(window[1])}: {last:.3f}")
    print(verdict)
    verdict.check()
