"""checkpointing.async_save: the background writer's checkpoints are the synchronous save's, byte
for byte (two real mpirun SFT ranks, a save every step, so each save waits for the previous
write). torch's .metadata is compared as what it holds: it names its own folder and a random
save_id (two synchronous saves differ there too), and manifest.json records its size."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from slurm_align.config import load_profile
from slurm_align.slurm.launch import launch_run
from tests.integration.test_ppo import tiny_run
from tests.support.preempt_support import assert_same_final_state, logs_text, stop_by_usr2_after_the_first_step
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


@pytest.mark.slow
def test_a_usr2_stop_during_a_background_write_resumes_exactly(ppo_reference, tmp_path):
    """The tiny PPO run of the preemption tests with async_save, on the local profile: the
    actor's background write of step 1 waits for the stop request (tests/programs/
    preempt_hold_actor.py, test_slow_write), so USR2 arrives while it is under way. The stop
    joins the writer before it records stopped_step: step 1 is committed, and the resumed run
    (the stock actor) ends as the uninterrupted reference run."""
    run_dir = tmp_path / "run"
    run = tiny_run(*ppo_reference.overrides, "checkpointing.async_save=true")
    run_dir.mkdir()
    (run_dir / "test_slow_write").write_text("")
    stop_by_usr2_after_the_first_step(run, load_profile("local"), run_dir)
    log = (run_dir / "logs" / "actor" / "rank0.log").read_text()
    assert "background write of step 1 goes on after the stop request" in log, logs_text(run_dir)
    assert (run_dir / "checkpoints" / "actor" / "iter_0000001" / "manifest.json").is_file(), logs_text(run_dir)
    job = launch_run(run, load_profile("local"), run_dir)
    assert job.wait(timeout_s=900) == "COMPLETED", logs_text(run_dir)
    assert "resuming from step 2" in (run_dir / "logs" / "actor" / "rank0.log").read_text()
    assert_same_final_state(run_dir, ppo_reference(), tmp_path)
