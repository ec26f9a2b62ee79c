"""checkpointing.async_save: the background writer's checkpoints are the synchronous save's, byte
for byte (two real mpirun SFT ranks, a save every step, so each save waits for the previous
write). torch's .metadata is compared as what it holds: it names its own folder and a random
save_id (two synchronous saves differ there too), and manifest.json records its size."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from tests.support.trainer_runs import make_run, train

STEPS = ["trainer.num_steps=2", "trainer.save_interval=1", "trainer.eval_interval=0", "data.val_path=null"]


def checkpoint_files(run_dir: Path) -> dict[str, object]:
    """Every file's bytes; .metadata unpickled without its storage_meta (folder, save_id), the
    manifest without .metadata's size."""
    root = run_dir / "checkpoints" / "sft"
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        name = str(p.relative_to(root))
        if p.name == ".metadata":
            meta = pickle.loads(p.read_bytes())
            meta.storage_meta = None
            out[name] = meta
        elif p.name == "manifest.json":
            manifest = json.loads(p.read_text())
            manifest["files"].pop(".metadata")
            out[name] = manifest
        elif p.is_file():
            out[name] = p.read_bytes()
    return out


def test_async_checkpoints_equal_the_synchronous_ones(tmp_path):
    sync = make_run(tmp_path / "sync", "sft_tiny.yaml", STEPS)
    background = make_run(tmp_path / "async", "sft_tiny.yaml", [*STEPS, "checkpointing.async_save=true"])
    train(sync, ranks=2)
    train(background, ranks=2)
    a, b = checkpoint_files(sync), checkpoint_files(background)
    assert sorted(a) == sorted(b) and [n for n in a if n.endswith("manifest.json")] == \
        [f"iter_{s:07d}/manifest.json" for s in (1, 2)], (sorted(a), sorted(b))
    assert any(n.endswith(".distcp") for n in a)
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, differ
    assert not list((background / "checkpoints" / "sft").glob("*.tmp"))
