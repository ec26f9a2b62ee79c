"""`submit --here` refusals, before anything is written (the run itself: tests/integration/test_submit.py)."""

from __future__ import annotations

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.launch import launch_run

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


def test_here_needs_an_allocation_of_enough_nodes_and_a_slurm_profile(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    run = load_run_config(EXAMPLE)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"inside an allocation .*SLURM_JOB_ID is not set"):
        launch_run(run, load_profile("local-slurm"), tmp_path / "a", here=True)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    with pytest.raises(ConfigError, match=r"allocation 77 of 2 nodes.*needs 3 nodes \(actor 2, critic 1"):
        launch_run(run, load_profile("local-slurm"), tmp_path / "b", here=True)
    with pytest.raises(ConfigError, match="give a Slurm profile"):
        launch_run(run, load_profile("local"), tmp_path / "c", here=True)
    assert not any((tmp_path / d).exists() for d in "abc")
