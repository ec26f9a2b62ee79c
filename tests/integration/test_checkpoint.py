"""Sharded checkpoints: TP=2 / PP=2 saves load with TP=1 (weights and AdamW state); a truncated
or unfinished checkpoint is refused with a clear error."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from slurm_align.models.checkpoint import MANIFEST, CheckpointError, find_latest, verify_checkpoint
from tests.support.layout_runs import LayoutRuns


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_checkpoint_saved_with_tp_or_pp_loads_with_tp1(layout_runs: LayoutRuns, tp: int, pp: int):
    """Saved by 2 ranks in the layout, loaded by 1 rank with TP=1 (the session's layout runs,
    tests/support/layout_runs.py); the TP=2 save with a shard cut in half is refused."""
    folder = layout_runs.folder(tp, pp)
    ckpt = find_latest(folder / "ckpt")
    assert ckpt is not None and ckpt.name == "iter_0000003"
    assert not list((folder / "ckpt").glob("*.tmp")), "temporary folder left behind"
    text = (folder / "load0.txt").read_text()
    assert "weight_err=0.0 " in text and "optim_err=0.0 " in text, text
    assert "step=3 consumed=48 opt_steps=[4.0]" in text, text

    if tp == 2:  # the damaged copy: the load must refuse it, naming the file
        damaged = find_latest(layout_runs.damaged / "ckpt")
        assert damaged is not None
        name = re.escape(layout_runs.damaged_shard)
        with pytest.raises(CheckpointError, match=name + ".*truncated|truncated.*" + name):
            verify_checkpoint(damaged)
        refused = (layout_runs.damaged / "load0.txt").read_text()
        assert re.search(r"CheckpointError: checkpoint .* is truncated", refused), refused


def test_unfinished_checkpoint_is_ignored_and_refused(tmp_path: Path):
    root = tmp_path / "ckpts"
    done, unfinished = root / "iter_0000002", root / "iter_0000004"
    for d in (done, unfinished):
        d.mkdir(parents=True)
        (d / "common.pt").write_bytes(b"x" * 10)
    (done / MANIFEST).write_text('{"step": 2, "files": {"common.pt": 10}}')
    (root / "iter_0000006.tmp").mkdir()  # a save that died before the rename
    assert find_latest(root) == done
    verify_checkpoint(done)
    with pytest.raises(CheckpointError, match=r"incomplete: no manifest\.json"):
        verify_checkpoint(unfinished)
    (done / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"file common\.pt is missing"):
        verify_checkpoint(done)
    shutil.rmtree(root)
    assert find_latest(root) is None
