"""`slurm-align generate` as a job on the local profile (2 ranks, data-parallel): the command,
launcher and rounds over two generation replicas write every prompt's samples once with their
top-K. (Resuming, seeds and the top-K values: tests/unit/algorithms/test_generate.py, in process.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.algorithms.generate import read_shards
from slurm_align.cli import main

SYNTH = REPO_ROOT / "examples" / "synthetic"
PROMPTS, SAMPLES = 12, 2


def test_generate_job_writes_each_prompt_once_with_its_top_k(tmp_path: Path, sft_checkpoint: Path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join((SYNTH / "prompts_val.jsonl").read_text().splitlines()[:PROMPTS]) + "\n")
    run_dir = tmp_path / "gen"
    cmd = ["generate", str(sft_checkpoint), "--data", str(data), "--config", str(REPO_ROOT / "examples/grpo_tiny.yaml"),
           "--profile", "local", "--samples", str(SAMPLES), "--top-k-logprobs", "3", "--shard-size", "5",
           "--run-dir", str(run_dir), "--follow", "actor.data_parallel=2"]
    assert main(cmd) == 0
    out = run_dir / "generate"
    rows = read_shards(out)
    assert Counter((r["index"], r["sample"]) for r in rows) == Counter(
        (i, j) for i in range(PROMPTS) for j in range(SAMPLES))
    assert all(len(r["topk_ids"]) == len(r["response_ids"]) and len(r["topk_ids"][0]) == 3 for r in rows)
    assert sum(r["response"].strip().isdigit() for r in rows) > PROMPTS, "the SFT policy answers in digits"

