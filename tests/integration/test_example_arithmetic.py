"""The arithmetic example (examples/arithmetic): its answers ride in the data, and its rule reward
and scorer read them.

The task's answer rides in each prompt row (`{"prompt": "7-3=", "answer": "4"}`), reaches
`slurm_align.rewards.arithmetic:exact_answer` as a keyword argument in training (reward.rule)
and in evaluation (eval.scorer). The test checks both against an independent scorer (the sum or
difference computed from the prompt's text): every stored rollout's reward and every held-out
row's score.

What it no longer claims: that GRPO raises this example's held-out accuracy. Its held-out set was
not held out (all of its prompts were in the training files); held out for real, the one-digit
task has 51 distinct held-out prompts, too few for a decided claim, and the measured gain was 0
(0.137 -> 0.137; on the training prompts 0.35 -> 0.29). The sort task's learning tests
(tests/support/learning.py, 2,000 held-out prompts) carry the learning claim.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.analysis.significance import read_results
from slurm_align.config import load_run_config
from slurm_align.models.tokenizer import ByteTokenizer
from slurm_align.rundir import RunDir
from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_grpo import launch

EXAMPLE = REPO_ROOT / "examples" / "arithmetic"
RULE = "slurm_align.rewards.arithmetic:exact_answer"
SFT_STEPS = 120


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


def arithmetic_answer(prompt: str) -> str:
    """The answer to 'a+b=' or 'a-b=', computed here from the text (not the row's answer field)."""
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", prompt).groups()
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


def independent_score(prompt: str, response: str) -> float:
    return float(response.strip() == arithmetic_answer(prompt))


@pytest.mark.slow
def test_arithmetic_rewards_and_scores_come_from_the_rows_answers(tmp_path):
    """SFT, then 2 GRPO steps with the example's rule reward and scorer: each stored rollout's
    reward and each held-out row's score equal the independent scorer's, and both runs have
    right and wrong answers (so a reward or scorer that ignored the answer, or scored another
    row's, would differ)."""
    data = generate(tmp_path / "data", EXAMPLE, "--max-operand", "9")
    assert_held_out(data)
    sft = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={data / 'sft_train.jsonl'}", f"data.val_path={data / 'sft_val.jsonl'}",
        "trainer.save_interval=0", f"trainer.num_steps={SFT_STEPS}"])
    launch(tmp_path, sft, name="sft")
    launch(tmp_path, grpo_config(data, tmp_path / "sft" / "checkpoints" / "sft", "ppo.num_steps=2", "eval.interval=2"),
           name="grpo")
    run = tmp_path / "grpo"
    rows = [json.loads(line) for line in (data / "prompts.jsonl").open()]
    assert all(r["answer"] == arithmetic_answer(r["prompt"]) for r in rows)
    store = RolloutStore.open(run / "rollouts.zarr", read_only=True)
    tok = ByteTokenizer()
    rewards, mine = [], []
    for step in (1, 2):
        got = store.read(step)
        po, ro = got["prompt_offsets"], got["response_offsets"]
        for i in range(len(got["reward"])):
            prompt = tok.decode(got["prompt_tokens"][po[i]:po[i + 1]].tolist())
            response = tok.decode(got["response_tokens"][ro[i]:ro[i + 1]].tolist())
            rewards.append(float(got["reward"][i]))
            mine.append(independent_score(prompt, response))
    assert rewards == mine
    assert 0 < sum(mine) < len(mine), f"every answer right or every answer wrong ({sum(mine)} of {len(mine)})"
    for step in RunDir(run).eval_steps():
        results = read_results(run, step)
        assert [r["score"] for r in results] == [independent_score(r["prompt"], r["response"]) for r in results]
        assert 0 < sum(r["correct"] for r in results) < len(results), step
