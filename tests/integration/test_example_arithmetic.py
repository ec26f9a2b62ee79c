"""The arithmetic example (examples/arithmetic) learns with its own rule reward and scorer.

The task's answer rides in each prompt row (`{"prompt": "7-3=", "answer": "4"}`), reaches
`slurm_align.rewards.arithmetic:exact_answer` as a keyword argument in training (reward.rule)
and in evaluation (eval.scorer), and val/score is the held-out exact-answer accuracy of greedy
answers. The data comes from the example's own generator at one-digit operands
(`--max-operand 9`): the two-digit default is beyond this tiny model on CPU (measured: 150 SFT
steps reach 4% held-out). The one-digit task has 155 distinct prompts: 51 are held out
(prompts_val, sft_val), and SFT and GRPO train on the other 104 only.

Measured (held-out every 20 steps): from the 120-step SFT policy's 0.115, GRPO at lr 2e-3
reaches 0.19, 0.195, 0.19; at 1e-3 0.18, 0.165, 0.18; at GRPO's 5e-4 of the sort task it stays
at 0.115. From a 40-step SFT policy (also 0.115) it does not rise at any of these rates.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_run_config
from slurm_align.slurm.render import Entry
from tests.integration.test_grpo import BROKEN_ACTOR, BROKEN_STEPS, accuracy_gain, launch, val_score

EXAMPLE = REPO_ROOT / "examples" / "arithmetic"
RULE = "slurm_align.rewards.arithmetic:exact_answer"
SFT_STEPS = 120
MARGIN = 0.06
"""Held-out accuracy gain the GRPO run must exceed (its twin: half of it). A margin on one
trajectory of 200 prompts, which are not held out (the one-digit task has about 190 distinct
problems, all of them in the training files): not yet decided like the sort task's learning tests
(tests/support/learning.py), which need a larger held-out set than this task has."""


def generate(folder: Path, example: Path = EXAMPLE, *args: str) -> Path:
    subprocess.run([sys.executable, str(example / "generate.py"), "--seed", "0", *args, "--out", str(folder)],
                   check=True, capture_output=True)
    return folder


def assert_held_out(folder: Path) -> int:
    """The held-out files' prompts are distinct and none is in a training file; returns how many."""
    prompts = {name: [r.get("prompt", r.get("input")) for r in map(json.loads, (folder / f"{name}.jsonl").open())]
               for name in ("sft_train", "sft_val", "prompts", "prompts_val")}
    for held in ("sft_val", "prompts_val"):
        repeated = len(prompts[held]) - len(set(prompts[held]))
        assert repeated == 0, f"{folder / held}.jsonl repeats {repeated} of its {len(prompts[held])} prompts"
        for train in ("sft_train", "prompts"):
            both = set(prompts[held]) & set(prompts[train])
            assert not both, f"{len(both)} prompts of {folder / held}.jsonl are in {train}.jsonl: {sorted(both)[:5]}"
    return len(prompts["prompts_val"])


def test_generator_writes_the_shipped_data_whose_held_out_prompts_are_held_out(tmp_path):
    assert assert_held_out(generate(tmp_path)) == 200
    assert assert_held_out(EXAMPLE) == 200
    for name in ("sft_train", "sft_val", "prompts", "prompts_val"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (EXAMPLE / f"{name}.jsonl").read_bytes(), name
    # the one-digit variant the learning test trains: a third of its 155 prompts held out
    assert assert_held_out(generate(tmp_path / "one_digit", EXAMPLE, "--max-operand", "9")) == 51


def grpo_config(data: Path, sft: Path, *overrides: str):
    return load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml", [
        f"data.train_path={data / 'prompts.jsonl'}", f"eval.val_path={data / 'prompts_val.jsonl'}",
        f"reward.rule={RULE}", f"eval.scorer={RULE}", f"model.init_checkpoint={sft}",
        # static sharding: the same samples on each rank whatever the machine's speed
        "switches.dynamic_prompts=false", "generation.max_new_tokens=4",
        "ppo.num_steps=60", "ppo.num_rollout_samples=32", "rl.n_samples_per_prompt=8",
        "ppo.global_batch_size=128", "ppo.actor_lr=2e-3", "eval.interval=60", *overrides])


@pytest.mark.slow
@pytest.mark.timeout(1500)   # three end-to-end runs: a hang guard sized for a loaded 2-core machine
def test_arithmetic_example_learns_with_its_rule_reward_and_its_broken_twin_does_not(tmp_path):
    data = generate(tmp_path / "data", EXAMPLE, "--max-operand", "9")
    assert_held_out(data)
    sft = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={data / 'sft_train.jsonl'}", f"data.val_path={data / 'sft_val.jsonl'}",
        "trainer.save_interval=0", f"trainer.num_steps={SFT_STEPS}"])
    launch(tmp_path, sft, name="sft")
    weak = tmp_path / "sft" / "checkpoints" / "sft"
    launch(tmp_path, grpo_config(data, weak), name="good")
    launch(tmp_path, grpo_config(data, weak, *BROKEN_STEPS), name="broken",
           entry=Entry(scripts={"actor": BROKEN_ACTOR}))
    good, broken = accuracy_gain(tmp_path / "good"), accuracy_gain(tmp_path / "broken")
    print(f"arithmetic: held-out exact-answer gain {good:+.3f}, broken twin {broken:+.3f}")
    start = val_score(tmp_path / "good")[0]
    assert 0.0 < start < 0.8, f"the SFT policy must be weak but not blank: held-out {start:.3f}"
    assert good > MARGIN, f"GRPO raised held-out accuracy by {good:+.3f} only (scores {val_score(tmp_path / 'good')})"
    assert broken < MARGIN / 2, f"the broken twin must not learn, yet gained {broken:+.3f} " \
                                f"(scores {val_score(tmp_path / 'broken')})"
