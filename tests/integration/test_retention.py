"""Checkpoint retention inside a real SFT run (one mpirun rank): the last k and the best k by a
metric are kept after every save, and a run resumed after pruning continues exactly. The first
run also has a torch profiler window (profiling.steps), whose trace is checked here too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slurm_align.models.retention import complete_steps
from tests.support.trainer_runs import make_run, train

pytestmark = pytest.mark.mpi
# The training loss falls step after step, so the best by the LARGEST loss is step 1: a kept step
# that keep_last alone would have deleted.
RETAIN = ["actor.data_parallel=1", "trainer.save_interval=1", "checkpointing.keep_last=2",
          "checkpointing.keep_best=1", "checkpointing.best_metric=loss", "checkpointing.best_mode=max"]


def test_retention_keeps_last_and_best_and_a_resume_after_pruning_continues_exactly(tmp_path: Path):
    a = train(make_run(tmp_path / "a", "sft_tiny.yaml", [*RETAIN, "trainer.num_steps=5", "profiling.steps=[2,3]"]))
    assert max(range(5), key=lambda i: a[i]["loss"]) == 0   # step 1 is the best by max loss
    assert complete_steps(tmp_path / "a" / "checkpoints" / "sft") == [1, 4, 5]
    # the same run's torch profiler window (profiling.steps): a Chrome trace of the rank
    trace = json.loads((tmp_path / "a" / "profile" / "actor_rank0.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])

    run_b = make_run(tmp_path / "b", "sft_tiny.yaml", [*RETAIN, "trainer.num_steps=3"])
    train(run_b)
    assert complete_steps(run_b / "checkpoints" / "sft") == [1, 2, 3]
    config = yaml.safe_load((run_b / "config.yaml").read_text())
    config["trainer"]["num_steps"] = 5   # the same run, longer: resumes from iter_3
    (run_b / "config.yaml").write_text(yaml.safe_dump(config))
    b = train(run_b)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * max(1.0, abs(ra["loss"])), (ra, rb)
    assert complete_steps(run_b / "checkpoints" / "sft") == [1, 4, 5]
