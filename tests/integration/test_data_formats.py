"""The sort task's prompts as users keep them train GRPO exactly as the JSONL file does: a 2-step
run on a parquet file with other column names stores the very rollouts (tokens, rewards) of the
JSONL run's first 2 steps, with the same seed and static prompt sharding (the shared
grpo_learning_run is that JSONL run: a shorter run is an exact prefix of a longer one, nothing
depends on num_steps).

One format runs end to end: what a job does with its data after reading it does not depend on
the format. The reading does, and each format (parquet, an Arrow file, a `datasets`
save_to_disk folder) is shown to give the JSONL file's token arrays and reward fields, through
both readers a job uses (the ranks' PromptDataset and submit's read_rows), by
tests/unit/data/test_sources.py::test_sort_prompts_with_other_column_names_give_the_jsonl_prompts_and_fields."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slurm_align.store.rollouts import RolloutStore
from tests.integration.test_grpo import SYNTH, launch_learning, learning_config

STEPS = 2


def _rows() -> list[dict]:
    return [json.loads(line) for line in (SYNTH / "prompts.jsonl").read_text().splitlines() if line.strip()]


def _write_parquet(folder: Path) -> list[str]:
    """The prompts as parquet under another column name beside a column of ours it does not have;
    the overrides that read them."""
    rows = _rows()
    path = folder / "prompts.parquet"
    pq.write_table(pa.table({"question": [r["prompt"] for r in rows], "id": list(range(len(rows)))}), path)
    return [f"data.train_path={path}", "data.columns.prompt=question"]


@pytest.mark.slow
def test_parquet_with_other_column_names_trains_grpo_as_the_jsonl_file_does(tmp_path, sft_checkpoint,
                                                                          grpo_learning_run):
    overrides = _write_parquet(tmp_path)
    run = learning_config(sft_checkpoint, "algorithm=grpo", f"ppo.num_steps={STEPS}", "eval.interval=0", *overrides)
    run_dir = launch_learning(tmp_path / "run", run)
    mine = RolloutStore.open(run_dir / "rollouts.zarr", read_only=True)
    ref = RolloutStore.open(grpo_learning_run / "rollouts.zarr", read_only=True)
    assert mine.steps.tolist() == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        a, b = mine.read(step), ref.read(step)
        for name in ("prompt_tokens", "response_tokens", "reward"):
            assert np.array_equal(a[name], b[name]), (step, name)
