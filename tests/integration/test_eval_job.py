"""`slurm-align eval` as a job of its own on the local profile: greedy answers of a checkpoint
equal the in-run evaluation of the same checkpoint, and the sampled evaluation's written
per-sample scores reproduce the pass@k it reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from slurm_align.cli import main
from slurm_align.models.checkpoint import find_latest

SYNTH = Path(__file__).resolve().parents[2] / "examples" / "synthetic"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_job_greedy_equals_in_run_eval_and_sampled_pass_at_k_matches_its_samples(
        tmp_path: Path, sft_checkpoint: Path, grpo_learning_run: Path):
    # The GRPO learning run evaluated its initial policy, the SFT checkpoint, as step 0.
    config, data = grpo_learning_run / "config.yaml", SYNTH / "prompts_val.jsonl"
    step = int(find_latest(sft_checkpoint).name.removeprefix("iter_"))   # type: ignore[union-attr]
    common = ["eval", str(sft_checkpoint), "--data", str(data), "--config", str(config), "--profile", "local",
              "--follow"]
    assert main([*common, "-P", "components.actor.tasks_per_node=1", "--run-dir", str(tmp_path / "greedy")]) == 0
    got = _rows(tmp_path / "greedy" / "eval" / f"step_{step}.jsonl")
    assert got == _rows(grpo_learning_run / "eval" / "step_0.jsonl")
    metrics = json.loads((tmp_path / "greedy" / "eval" / f"metrics_step_{step}.json").read_text())
    assert metrics["val/pass@1"] == pytest.approx(np.mean([r["correct"] for r in got]), abs=1e-12)

    # Sampled, 8 answers per prompt, data-parallel over 2 ranks, on the first 200 prompts.
    assert main([*common, "--samples", "8", "--temperature", "1.0", "--out", str(tmp_path / "sampled"),
                 "actor.data_parallel=2", "eval.num_prompts=200"]) == 0
    rows = _rows(tmp_path / "sampled" / "eval" / f"step_{step}.jsonl")
    metrics = json.loads((tmp_path / "sampled" / "eval" / f"metrics_step_{step}.json").read_text())
    assert [r["index"] for r in rows] == list(range(200))
    correct = np.array([[s["score"] >= 1.0 for s in r["samples"]] for r in rows])
    assert correct.shape == (200, 8)
    assert metrics["val/pass@1"] == pytest.approx(np.mean(correct.mean(axis=1)), abs=1e-12)
    assert metrics["val/pass@8"] == pytest.approx(np.mean(correct.any(axis=1)), abs=1e-12)
    assert metrics["val/pass@1"] < metrics["val/pass@8"], "8 tries find more than one on a weak policy"
    texts = {s["response"] for r in rows for s in r["samples"]}
    assert len(texts) > 200, "sampled answers differ within prompts"
