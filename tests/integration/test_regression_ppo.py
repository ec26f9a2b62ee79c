"""PPO with a regression (multi-attribute) reward model as its reward: the critic serves the RM's
attributes weighted by reward.attribute_weights (here correctness only), the actor starts from
the session's SFT policy (`sft_checkpoint`), and the held-out exact-sort accuracy of greedy
answers to the 2,000 held-out prompts (the task's own rule, not the RM) is the verdict, with the
learning tests' statistics (tests/support/learning.py: exact sign tests on the prompts that
changed, the run's end pooled over its last evaluations). The broken twin is the same run with
the correctness weight negated: the same RM, PPO settings and start, only the direction of the
RM's signal reversed, so a gain that came from PPO's dynamics (KL, clipping, sharpening) rather
than from what the RM knows would show in the twin too.

The regression RM (examples/rm_tiny.yaml with loss 'regression', 2 labels) trains on
HelpSteer2-format rows (slurm_align/data/helpsteer.py) in two rounds: the task's chosen and
rejected answers and the SFT policy's own samples (8 per prompt, temperature 1, on 2,000 prompts
of their own: none of the task's training or held-out prompts), labelled by the task's rule;
then, from that RM, the same rows and the samples of a PPO policy that gamed it (1,000 more
prompts of their own). PPO runs 15 steps of 128 rollouts at actor lr 3e-4 with a KL penalty of
0.2 (KL_COEF).

Minutes of sampling, reward-model and PPO training: opt-in with SLURM_ALIGN_REGRESSION_PPO=1.

Measured (this host, loaded; tests/README.md has the wall time):
- On the task's rows alone the RM was gamed: PPO (32 rollouts, lr 1e-3) raised its correctness
  2.75 -> 3.71 while held-out exact accuracy fell 0.268 -> 0.011 and answers shortened 6.4 -> ~4.
- With the SFT policy's samples (first round alone, 3,000 steps): Pearson of correctness 0.885 on
  the task's held-out rows but 0.51 on the policy's held-out samples; PPO on it still fell
  0.268 -> 0.07 (answers sorted-looking with the wrong digits: '2469' for '3954').
- PPO's settings alone: on the task's own rule (exact x 4, no RM) the earlier 32 rollouts at lr
  1e-3 lowered accuracy too (0.268 -> 0.214); 128 at 3e-4 raised it (0.268 -> 0.339).
- Two rounds, the second 5,500 steps cosine from the first: Pearson (correctness, verbosity)
  0.904, 0.989 on the task's held-out rows, 0.73, 0.99 on the policies' held-out samples; PPO
  0.268 -> 0.286 (pooled end; 153 prompts wrong -> right, 116 right -> wrong, p = 0.014), the
  twin 0.268 -> 0.009: not significant at 1e-3. That RM trained 4,000 steps more (cosine to 5e-5;
  0.75 on the SFT policy's samples): 0.268 -> 0.293, p = 9.4e-4. An RM trained longer in another
  recipe (0.838 on the SFT policy's samples): 0.268 -> 0.306 (160 / 83, p = 4.4e-7).
- The fixture as it stands (second round 1,500 steps at lr 1e-3, then 4,000 cosine to 5e-5):
  Pearson 0.928, 0.985 on the task's held-out rows, 0.736, 0.985 on the policies' samples; PPO
  0.268 -> 0.296 (156 / 100, p = 2.8e-4), reward 0.535 -> 0.753; the twin 0.268 -> 0.010 (run
  over twin 575 / 3). It passes, with a thin margin (alpha 1e-3): the RM's correlation with the
  policy's own samples decides (0.70: p = 0.014, 0.74-0.75: 3e-4-9e-4, 0.84: 4e-7), so an RM
  that reaches ~0.84 there is what would make the verdict hold on every host; a first round of
  4,500 steps and a second of 4,000 cosine gave 0.646 there (not run to PPO's verdict); a second
  round of 3,000 steps at lr 1e-3 then 4,000 cosine gave 0.788 there (0.931 on the task's rows)
  and NO gain: 0.268 -> 0.271 (164 / 159, p = 0.41), twin 0.019. The correlation alone does not
  decide: at KL 0.05 the verdict is not robust to the RM's recipe (the KL penalty is: below).
- The fixture is deterministic on one rank: two runs gave the same Pearson and PPO counts.
- That PPO setting (KL 0.05, 30 steps) on another host (AVX-512; the fixture rebuilt there gave
  the same Pearson to the last digit): FAILS,
  0.268 -> 0.291 (180 / 134, p = 5.5e-3), and 0.292 (153 / 104, p = 1.3e-3) with every process
  on the AVX2 path. Its held-out score peaks within 5-15 steps and falls after (the RM is gamed
  as the policy moves off what it was trained on): KL 0.2 over 15 steps, the test's setting now,
  measured on the RM built under each path (benchmarks/learning_spread.py's environments):
  native (this test as written, 319 s in all on an idle host) 0.268 -> 0.2975 (117 / 58,
  p = 4.8e-6), reward 0.563 -> 0.765, twin 0.268 -> 0.110; avx2 0.315 (147 / 53, p = 1e-11);
  default 0.304 (127 / 55, p = 5e-8); on the RM of the other recipe above (second round 3,000
  steps, which gave p = 0.41 at KL 0.05; native): 0.311 (149 / 63, p = 1.6e-9); KL 0.5: 0.300
  (107 / 43, p = 9e-8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slurm_align import REPO_ROOT
from slurm_align.cli import main as cli
from slurm_align.data import helpsteer
from slurm_align.data.helpsteer import ATTRIBUTES
from slurm_align.models.checkpoint import find_latest
from tests.integration.test_ppo import launch_learning
from tests.support import learning
from tests.support.trainer_runs import make_run, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("SLURM_ALIGN_REGRESSION_PPO") != "1",
    reason="minutes of regression reward-model and PPO training: set SLURM_ALIGN_REGRESSION_PPO=1")]

SYNTH = REPO_ROOT / "examples" / "synthetic"
GRPO = REPO_ROOT / "examples" / "grpo_tiny.yaml"    # a rollout config: what generate takes
RM_STEPS, RM2_STEPS, RM2_COSINE_STEPS = 3000, 1500, 4000
"""The RM's first round (lr 1e-3), its second (from the first, lr 1e-3), then the second round's
data again from there with lr 1e-3 cosine to 5e-5."""
PPO_ROUND_1 = ["critic_model.num_labels=2", "reward.attribute_weights=[1.0,0.0]", "ppo.num_steps=30",
               "ppo.kl_coef=0.05", "switches.dynamic_prompts=false", "ppo.num_rollout_samples=32",
               "generation.max_new_tokens=12", "generation.prompt_batch_size=4", "ppo.train_micro_batch_size=8",
               "ppo.actor_lr=1e-3"]
"""PPO that games the first-round RM (the policy whose samples the second round labels)."""
PPO_STEPS = int(os.environ.get("SLURM_ALIGN_REGRESSION_PPO_STEPS", "15"))
EVAL_INTERVAL = 5
"""Evaluations at 0, 5, 10, 15: the run's end is pooled over its last three (learning.POOLED)."""
KL_COEF = 0.2
"""PPO's KL penalty: what keeps the policy where the RM was trained (its samples and the SFT
policy's). At 0.05 over 30 steps the gain was a coin flip of the RM's recipe and the host (p from
2.8e-4 to 0.41, module docstring); at 0.2 over 15 steps p <= 5e-6 on every path and recipe tried."""
WEIGHTS = "[1.0,0.0]"
"""reward = 1.0 x correctness + 0.0 x verbosity (ATTRIBUTES' order)."""
TWIN_WEIGHTS = "[-1.0,0.0]"
MIN_PEARSON = 0.8


def sample(policy: Path, prompts: Path, run_dir: Path) -> Path:
    """8 samples (temperature 1) of `policy` per prompt; the generate folder."""
    assert cli(["generate", str(policy), "--data", str(prompts), "--config", str(GRPO), "--samples", "8",
                "--temperature", "1.0", "--profile", "local", "--run-dir", str(run_dir), "--follow"]) == 0
    return run_dir / "generate"


def train_rm(run_dir: Path, data: tuple[Path, Path], steps: int, *extra: str) -> Path:
    run_dir = make_run(run_dir, "rm_tiny.yaml", [
        f"data.train_path={data[0]}", f"data.val_path={data[1]}", "actor.data_parallel=1",
        "model.num_labels=2", "loss.name=regression", f"loss.options.attributes=[{','.join(ATTRIBUTES)}]",
        f"trainer.num_steps={steps}", "trainer.lr=1.0e-3", "trainer.save_interval=0", *extra])
    train(run_dir, timeout=3000)
    latest = find_latest(run_dir / "checkpoints" / "rm")
    assert latest is not None, f"{run_dir}: no checkpoint"
    return latest


@pytest.fixture(scope="module")
def regression_rm(tmp_path_factory: pytest.TempPathFactory, sft_checkpoint: Path) -> tuple[Path, Path]:
    """The regression RM (correctness, verbosity), in two rounds (iterated RLHF): on the task's
    chosen and rejected answers and the SFT policy's own samples; then, from it, on those and the
    samples of a PPO policy that gamed it (PPO_ROUND_1). Every sample is on prompts of its own
    (none of the task's training or held-out prompts) and labelled by the task's rule.
    (its checkpoint, its data folder)."""
    folder = tmp_path_factory.mktemp("regression_rm")
    seen = [str(p) for p in sorted(SYNTH.glob("*.jsonl"))]
    helpsteer.main([str(folder / "data1"), "--prompts", "2000", "--exclude", *seen])
    sft_samples = sample(sft_checkpoint, folder / "data1" / "policy_prompts.jsonl", folder / "samples1")
    rm1 = train_rm(folder / "rm1", helpsteer.write_policy_rows(folder / "data1", sft_samples), RM_STEPS)
    gamed = launch_learning(folder / "ppo1", [f"model.init_checkpoint={sft_checkpoint}",
                                              f"critic_model.init_checkpoint={rm1}", *PPO_ROUND_1])
    helpsteer.main([str(folder / "data2"), "--prompts", "1000", "--exclude", *seen,
                    str(folder / "data1" / "policy_prompts.jsonl")])
    ppo_samples = sample(gamed / "checkpoints" / "actor", folder / "data2" / "policy_prompts.jsonl",
                         folder / "samples2")
    data = helpsteer.write_policy_rows(folder / "data2", [sft_samples, ppo_samples])
    rm2 = train_rm(folder / "rm2", data, RM2_STEPS, f"model.init_checkpoint={rm1}")
    rm3 = train_rm(folder / "rm3", data, RM2_COSINE_STEPS, f"model.init_checkpoint={rm2}",
                   "training.lr_decay_style=cosine", "training.min_lr=5.0e-5")
    return rm3, folder / "data2"


def pearson(rm: Path, rows: list[dict], folder: Path) -> dict[str, float]:
    """Per attribute: Pearson's r of the RM's predictions (steerlm-label) with the rows' labels."""
    src, out = folder / "rows.jsonl", folder / "predicted.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # In its own process: steerlm-label runs the model in the calling process, and a pytest process
    # that has been an MPI rank cannot start the PPO runs' mpirun afterwards (they exit 1, no log).
    subprocess.run([str(Path(sys.executable).parent / "slurm-align"), "steerlm-label", str(rm), "--data", str(src),
                    "--out", str(out)], check=True, capture_output=True)
    pred = [json.loads(line) for line in out.read_text().splitlines()]
    return {a: float(np.corrcoef([r[a] for r in rows], [p[a] for p in pred])[0, 1]) for a in ATTRIBUTES}


@pytest.mark.timeout(3600)
def test_the_regression_rms_attributes_correlate_with_held_out_labels(tmp_path: Path, regression_rm):
    """On the task's held-out rows (pref_val's chosen and rejected answers) each predicted
    attribute correlates with the rule's label (Pearson >= 0.8). Its correlation on the policies'
    samples of held-out prompts (what PPO's reward is about) is printed: measured 0.73
    (correctness) and 0.99 (verbosity); an RM of the first round alone had 0.51 for correctness."""
    rm, data = regression_rm
    val = [json.loads(line) for line in (data / "helpsteer_policy_val.jsonl").read_text().splitlines()]
    # the second round's held-out rows: the task's, then samples of the SFT and the gamed PPO policy
    task = helpsteer.helpsteer_rows_of(SYNTH / "pref_val.jsonl", helpsteer.chosen_and_rejected)
    policy = val[len(task):]
    assert val[:len(task)] == task and policy
    r = {}
    for name, rows in (("task", task), ("policy", policy)):
        (tmp_path / name).mkdir()
        r[name] = pearson(rm, rows, tmp_path / name)
        print(f"{name}'s held-out rows ({len(rows)}): Pearson {r[name]}")
    assert all(v >= MIN_PEARSON for v in r["task"].values()), r


def ppo_run(sft: Path, rm: Path, weights: str) -> list[str]:
    # 128 rollouts a step at actor lr 3e-4: with the test's earlier 32 at 1e-3, PPO on the task's
    # own rule (exact sort, weight 4) lowered held-out accuracy too (0.268 -> 0.214); at these
    # settings it raised it (0.268 -> 0.339). The KL penalty: KL_COEF.
    return [f"model.init_checkpoint={sft}", f"critic_model.init_checkpoint={rm}", "critic_model.num_labels=2",
            f"reward.attribute_weights={weights}", f"ppo.num_steps={PPO_STEPS}", f"ppo.kl_coef={KL_COEF}",
            "switches.dynamic_prompts=false", "ppo.num_rollout_samples=128", "generation.max_new_tokens=12",
            "generation.prompt_batch_size=4", "ppo.train_micro_batch_size=16", "ppo.actor_lr=3e-4",
            f"eval.val_path={SYNTH / 'prompts_val.jsonl'}", "eval.scorer=slurm_align.rewards.sort:exact",
            f"eval.interval={EVAL_INTERVAL}"]


@pytest.mark.timeout(3600)
def test_ppo_on_the_regression_rms_weighted_attributes_raises_held_out_accuracy(
        tmp_path: Path, sft_checkpoint: Path, regression_rm):
    rm, _ = regression_rm
    good = launch_learning(tmp_path / "good", ppo_run(sft_checkpoint, rm, WEIGHTS))
    twin = launch_learning(tmp_path / "twin", ppo_run(sft_checkpoint, rm, TWIN_WEIGHTS))
    verdict = learning.verdict("regression_ppo", good, twin)
    window = range(1, 1 + EVAL_INTERVAL), range(PPO_STEPS - EVAL_INTERVAL + 1, PPO_STEPS + 1)
    for name, run_dir in (("run", good), ("twin", twin)):   # what PPO optimised: the RM's weighted attributes
        first, last = (learning.step_rewards(run_dir, w).mean() for w in window)
        print(f"{name}: mean reward of steps {list(window[0])}: {first:.3f}, of steps {list(window[1])}: {last:.3f}")
    print(verdict)
    verdict.check()
