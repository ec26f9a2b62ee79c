"""The sort task's prompts as users keep them (parquet with other column names, an Arrow file, a
`datasets` save_to_disk folder) train GRPO exactly as the JSONL file does: each format's 2-step
run stores the very rollouts (tokens, rewards) of the JSONL run's first 2 steps, with the same
seed and static prompt sharding (the shared grpo_learning_run is that JSONL run: a shorter run
is an exact prefix of a longer one, nothing depends on num_steps)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_grpo import SYNTH, launch_learning, learning_config

STEPS = 2


def _rows() -> list[dict]:
    return [json.loads(line) for line in (SYNTH / "prompts.jsonl").read_text().splitlines() if line.strip()]


def _write(fmt: str, folder: Path) -> tuple[Path, list[str]]:
    """The prompts in `fmt`, and the overrides that read them."""
    rows = _rows()
    if fmt == "parquet":   # another column name, and a column of ours it does not have
        path = folder / "prompts.parquet"
        pq.write_table(pa.table({"question": [r["prompt"] for r in rows], "id": list(range(len(rows)))}), path)
        return path, [f"data.train_path={path}", "data.columns.prompt=question"]
    table = pa.table({"prompt": [r["prompt"] for r in rows]})
    if fmt == "arrow":
        path = folder / "prompts.arrow"
        feather.write_feather(table, path)
    else:
        from datasets import Dataset

        path = folder / "prompts_disk"
        Dataset(table).save_to_disk(str(path))
    return path, [f"data.train_path={path}"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "arrow", "save_to_disk"])
def test_each_format_trains_grpo_as_the_jsonl_file_does(tmp_path, sft_checkpoint, grpo_learning_run, fmt):
    _, overrides = _write(fmt, tmp_path)
    run = learning_config(sft_checkpoint, "algorithm=grpo", f"ppo.num_steps={STEPS}", "eval.interval=0", *overrides)
    run_dir = launch_learning(tmp_path / "run", run)
    mine = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    ref = RolloutStore.open(grpo_learning_run / "rollouts.zarr", read_only=True)
    assert mine.steps.tolist() == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        a, b = mine.read(step), ref.read(step)
        for name in ("prompt_tokens", "response_tokens", "reward"):
            assert np.array_equal(a[name], b[name]), (fmt, step, name)
