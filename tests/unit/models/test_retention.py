"""Checkpoint retention (models/retention.py) on checkpoint folders laid out as save_checkpoint
lays them out; the same rules inside a real training run are in tests/integration/test_retention.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.models.checkpoint_names import MANIFEST, find_latest, iter_dir
from slurm_align.models.retention import PRUNING, complete_steps, prune, read_scores, steps_to_keep
from tests.support.trainer_runs import ROOT


def _checkpoints(root: Path, steps: list[int]) -> None:
    for step in steps:
        folder = iter_dir(root, step)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"x" * 10)
        (folder / MANIFEST).write_text(json.dumps({"step": step, "files": {"__0_0.distcp": 10}}))


def test_keeps_the_last_k_and_the_best_k_by_the_metric():
    steps = [1, 2, 3, 4, 5, 6]
    scores = {1: 0.2, 2: 0.9, 3: 0.5, 4: 0.9, 5: 0.1}   # step 6 not evaluated
    assert steps_to_keep(steps, keep_last=2) == {5, 6}
    assert steps_to_keep(steps, 2, keep_best=1, scores=scores) == {4, 5, 6}       # a tie: the newer
    assert steps_to_keep(steps, 1, keep_best=2, scores=scores) == {2, 4, 6}
    assert steps_to_keep(steps, 1, keep_best=2, scores=scores, mode="min") == {1, 5, 6}
    assert steps_to_keep(steps, keep_last=0) == set(steps)                        # 0: keep all


def test_prune_deletes_only_what_is_not_kept_and_never_the_newest(tmp_path):
    root, critic = tmp_path / "actor", tmp_path / "critic"
    _checkpoints(root, [10, 20, 30, 40])
    critic.mkdir()
    for step in (10, 20, 30, 40):
        (critic / f"iter_{step:07d}.pt").write_bytes(b"c")
    (root / "iter_0000050.tmp").mkdir()            # a save in flight: not ours to touch
    (root / "iter_0000045").mkdir()                # no manifest: not a complete checkpoint
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 10, "val/score": 0.7}, {"step": 20, "val/score": 0.3}, {"step": 20, "val/score": 0.8},
        {"step": 30, "val/score": 0.1}, {"step": 40, "loss": 1.0}]))
    scores = read_scores(metrics, "val/score")
    assert scores == {10: 0.7, 20: 0.8, 30: 0.1}   # a step logged again (resume): the last record
    gone = prune(root, keep_last=1, keep_best=1, scores=scores, companions=lambda s: [critic / f"iter_{s:07d}.pt"])
    assert gone == [10, 30]
    assert complete_steps(root) == [20, 40] and find_latest(root) == iter_dir(root, 40)
    assert sorted(p.name for p in critic.iterdir()) == ["iter_0000020.pt", "iter_0000040.pt"]
    assert (root / "iter_0000050.tmp").is_dir() and (root / "iter_0000045").is_dir()
    assert prune(root, keep_last=1, keep_best=0) == [20]
    assert complete_steps(root) == [40]


def test_a_prune_killed_while_deleting_leaves_a_resumable_run(tmp_path, monkeypatch):
    root = tmp_path / "actor"
    _checkpoints(root, [1, 2, 3])

    def killed(path, *args, **kwargs):   # the job dies once the first folder is renamed
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        prune(root, keep_last=1)
    monkeypatch.undo()
    assert (root / f"{PRUNING}iter_0000001").is_dir()   # half gone, and named so no reader takes it
    assert find_latest(root) == iter_dir(root, 3) and complete_steps(root) == [2, 3]
    assert prune(root, keep_last=1) == [2]             # the next prune finishes the job
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003"]


def test_keep_best_needs_a_metric_and_keep_last():
    example = ROOT / "examples" / "sft_tiny.yaml"
    with pytest.raises(ConfigError, match=r"checkpointing.best_metric.*keep_best=2 needs the metric"):
        load_run_config(example, ["checkpointing.keep_last=1", "checkpointing.keep_best=2"])
    with pytest.raises(ConfigError, match=r"checkpointing.keep_last.*prunes only beside keep_last >= 1"):
        load_run_config(example, ["checkpointing.keep_best=1", "checkpointing.best_metric=val_loss"])
