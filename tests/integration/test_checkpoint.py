"""Sharded checkpoints: TP=2 / PP=2 saves load with TP=1 (weights and AdamW state); a truncated
or unfinished checkpoint is refused with a clear error."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from slurm_align.models.checkpoint import MANIFEST, CheckpointError, find_latest, verify_checkpoint
from tests.integration.test_models_parallel import mpirun


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_checkpoint_saved_with_tp_or_pp_loads_with_tp1(tmp_path: Path, tp: int, pp: int):
    mpirun(2, "ckpt_save", str(tp), str(pp), str(tmp_path))
    ckpt = find_latest(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.name == "iter_0000003"
    assert not list((tmp_path / "ckpt").glob("*.tmp")), "temporary folder left behind"
    mpirun(1, "ckpt_load", "1", "1", str(tmp_path))
    text = (tmp_path / "load0.txt").read_text()
    assert "weight_err=0.0 " in text and "optim_err=0.0 " in text, text
    assert "step=3 consumed=48 opt_steps=[4.0]" in text, text

    if tp == 2:  # damage the checkpoint: the load must refuse it, naming the file
        shard = sorted(ckpt.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        name = re.escape(shard.name)
        with pytest.raises(CheckpointError, match=name + ".*truncated|truncated.*" + name):
            verify_checkpoint(ckpt)
        with pytest.raises(RuntimeError, match=r"CheckpointError: checkpoint .* is truncated"):
            mpirun(1, "ckpt_load", "1", "1", str(tmp_path))


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
