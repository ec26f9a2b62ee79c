"""On-policy distillation with a teacher component (slurm_align/critic/teacher.py): the student
(the session's weak SFT policy) samples, the teacher (the session's GRPO-trained policy: the main
job's trained policy) scores its samples per token, and the student's only reward is minus the
reverse KL to the teacher (no rule reward). Held-out exact accuracy (an independent scorer: the
sort rule, never the reward) must rise; the control, whose teacher is the student's own initial
weights, must not. Decided by the learning tests' exact sign tests (tests/support/learning.py).

Minutes of CPU: opt in with SLURM_ALIGN_KD_LEARNING=1."""

from __future__ import annotations

import os

import pytest

from slurm_align.config.loading import apply_overrides, read_yaml, validate
from slurm_align.config.run import RunConfig
from tests.integration.test_grpo import BROKEN_STEPS, EXAMPLES, LEARN, SYNTH, launch_learning
from tests.support import learning

pytestmark = pytest.mark.skipif(os.environ.get("SLURM_ALIGN_KD_LEARNING") != "1",
                                reason="on-policy distillation's learning test takes minutes: "
                                       "SLURM_ALIGN_KD_LEARNING=1")

KD = ["reward.rule=null", "reward.model=false", "eval.scorer=slurm_align.rewards.sort:exact",
      "ppo.num_steps=20", "eval.interval=5"]


def distill_config(student, teacher, *overrides: str) -> RunConfig:
    base = EXAMPLES / "grpo_tiny.yaml"
    data = apply_overrides(read_yaml(base), [f"data.train_path={SYNTH / 'prompts.jsonl'}",
                                             f"eval.val_path={SYNTH / 'prompts_val.jsonl'}",
                                             f"model.init_checkpoint={student}", *LEARN, *KD, *overrides], str(base))
    data["teacher_model"] = {**data["model"], "init_checkpoint": str(teacher)}   # the student's shape
    run = validate(RunConfig, data, "distill_config")
    assert run.components == ("actor", "teacher") and run.reward.rule is None
    return run


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_on_policy_distillation_raises_accuracy_and_its_self_teacher_control_does_not(
        tmp_path, sft_checkpoint, grpo_learning_run):
    trained = grpo_learning_run / "checkpoints" / "actor"
    good = launch_learning(tmp_path / "kd", distill_config(sft_checkpoint, trained))
    control = launch_learning(tmp_path / "self", distill_config(sft_checkpoint, sft_checkpoint, *BROKEN_STEPS))
    verdict = learning.verdict("on_policy_distillation", good, control)
    print(verdict)
    verdict.check()
