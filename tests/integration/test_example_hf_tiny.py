"""examples/hf_tiny end to end at a reduced size: make the tiny Llama folder, SFT (TP=2) -> reward
model -> PPO on the local profile, export the PPO policy as a Hugging Face folder, and load it with
transformers: the exported model gives the logits of the PPO policy's own checkpoint.

The example's own YAML files, with fewer steps; the model and data go to the test's folder, not
into examples/ (make_model.py's HERE is pointed there).

Opt-in (SLURM_ALIGN_HF_TINY_EXAMPLE=1): four CLI runs, 64 CPU-s (a minute of the suite's wall on a
2-core host). The suite keeps each part on tiny HF models: import, train and export round trips
and logits equal to transformers' (integration/test_hf_models.py, test_hf_qwen3_moe.py), the
CLI's train and submit commands (test_trainers_cli.py, test_submit.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_align import REPO_ROOT

transformers = pytest.importorskip("transformers")

EXAMPLE = REPO_ROOT / "examples" / "hf_tiny"


def cli(*args: str, timeout: int = 900) -> None:
    proc = subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"slurm-align {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def make_model(folder: Path) -> tuple[Path, Path]:
    spec = importlib.util.spec_from_file_location("hf_tiny_make_model", EXAMPLE / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.HERE = folder   # chat data to folder/data, not into examples/
    module.main(folder / "model")
    return folder / "model", folder / "data"


@pytest.mark.skipif(os.environ.get("SLURM_ALIGN_HF_TINY_EXAMPLE") != "1",
                    reason="examples/hf_tiny end to end: set SLURM_ALIGN_HF_TINY_EXAMPLE=1")
@pytest.mark.slow
@pytest.mark.timeout(1500)   # two or more end-to-end runs: a hang guard sized for a loaded 2-core machine
def test_hf_tiny_sft_rm_ppo_export_loads_in_transformers(tmp_path):
    model, data = make_model(tmp_path)
    runs = tmp_path / "runs"
    short = ["trainer.num_steps=4"]
    cli("train", "sft", str(EXAMPLE / "sft.yaml"), "--profile", "local", "--run-dir", str(runs / "sft"), "--follow",
        f"model.hf_path={model}", f"data.train_path={data / 'sft_train.jsonl'}",
        f"data.val_path={data / 'sft_val.jsonl'}", *short)
    cli("train", "rm", str(EXAMPLE / "rm.yaml"), "--profile", "local", "--run-dir", str(runs / "rm"), "--follow",
        f"model.hf_path={model}", f"data.train_path={data / 'pref_train.jsonl'}",
        f"data.val_path={data / 'pref_val.jsonl'}", *short)
    cli("submit", str(EXAMPLE / "ppo.yaml"), "--profile", "local", "--run-dir", str(runs / "ppo"), "--follow",
        f"model.hf_path={model}", f"critic_model.hf_path={model}", f"data.train_path={data / 'prompts.jsonl'}",
        f"model.init_checkpoint={runs / 'sft' / 'checkpoints' / 'sft'}",
        f"critic_model.init_checkpoint={runs / 'rm' / 'checkpoints' / 'rm'}",
        "ppo.num_steps=1", "ppo.num_rollout_samples=8", "generation.max_new_tokens=8")
    cli("export", "hf", str(runs / "ppo" / "checkpoints" / "actor"), str(tmp_path / "policy_hf"))

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy_hf")
    start = transformers.AutoModelForCausalLM.from_pretrained(model)
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert exported.config.vocab_size == start.config.vocab_size
    tokens = torch.randint(0, start.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(tokens).logits
    assert torch.isfinite(logits).all()
    # Trained (SFT, then PPO): not the random initial weights any more.
    with torch.no_grad():
        assert (logits - start(tokens).logits).abs().max().item() > 1e-3
