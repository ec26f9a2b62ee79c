"""Installed, not checked out: a wheel built from this tree, installed into a fresh venv, renders
and runs a job from a directory that has nothing to do with the checkout.

The fresh venv gets its dependencies (torch, megatron-core, mpi4py, ...) from the test
interpreter's site-packages through a .pth line, so no registry is needed; slurm_align itself
comes only from the wheel (the fresh site-packages come first on sys.path, and the editable
install's import hook is not loaded there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

import slurm_align
from slurm_align import REPO_ROOT, resources
from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.slurm.launch import resolve_input_paths

SOURCES = ("slurm_align", "launchers", "sbatch_templates", "cluster_profiles", "setup.cfg",
           "pyproject.toml", "README.md")


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A venv with slurm-align installed from a wheel of this tree (and nothing else of it)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"   # built from a copy: an in-tree build would write build/ into the checkout
    src.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(wheels), str(src)], cwd=tmp)
    (wheel,) = wheels.glob("slurm_align-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp).stdout.strip())
    (site / "deps-from-test-env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
          "--no-index", str(wheel)], cwd=tmp)
    return venv


@pytest.mark.slow
def test_wheel_ships_templates_launchers_profiles(fresh_venv, tmp_path):
    code = ("import slurm_align, json\nfrom slurm_align import resources as r\n"
            "print(json.dumps({'pkg': slurm_align.__file__, 'templates': str(r.folder(r.TEMPLATES)),"
            " 'launchers': r.launcher_names(),"
            " 'profiles': sorted(p.name for p in r.folder(r.PROFILES).glob('*.yaml'))}))")
    got = json.loads(_run([str(fresh_venv / "bin" / "python"), "-c", code], cwd=tmp_path).stdout)
    for key in ("pkg", "templates"):
        assert got[key].startswith(str(fresh_venv)), got   # the wheel's copy, not the checkout
    # every launcher of the checkout (launchers/, one per component kind and entry), and only those
    shipped = sorted(p.stem for p in (REPO_ROOT / "launchers").glob("*.py") if p.stem != "__init__")
    assert len(shipped) >= 9 and got["launchers"] == shipped
    assert {"local.yaml", "local-slurm.yaml", "example-gpu-cluster.yaml"} <= set(got["profiles"])
    assert (Path(got["templates"]) / "hetjob.sh.j2").is_file()


@pytest.mark.slow
@pytest.mark.mpi
def test_submit_from_an_unrelated_directory(fresh_venv, tmp_path):
    """A user's project folder: a run config and its data, no checkout. render, then submit the
    tiny run's components (the report launcher) on the local profile and wait for them."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl", project / "data" / "prompts.jsonl")
    config = yaml.safe_load((REPO_ROOT / "examples" / "ppo_tiny.yaml").read_text())
    config["data"]["train_path"] = "data/prompts.jsonl"
    (project / "ppo.yaml").write_text(yaml.safe_dump(config))
    cli = str(fresh_venv / "bin" / "slurm-align")

    script = _run([cli, "render", "ppo.yaml", "--profile", "local", "--run-dir", "runs/r"], cwd=project).stdout
    assert str(REPO_ROOT) not in script
    assert f"cd {project / 'runs' / 'r'}" in script and "-m slurm_align.launchers.actor" in script

    _run([cli, "submit", "ppo.yaml", "--profile", "local", "--run-dir", "runs/r", "--entry", "report",
          "--follow"], cwd=project)
    run_dir = project / "runs" / "r"
    reports = sorted((json.loads(p.read_text()) for p in (run_dir / "reports").glob("*/rank*.json")),
                     key=lambda r: (r["component"], r["rank"]))
    assert [(r["component"], r["rank"]) for r in reports] == [("actor", 0), ("actor", 1), ("critic", 0)]
    assert {p.name for p in (run_dir / "logs" / "actor").glob("rank*.log")} == {"rank0.log", "rank1.log"}
    assert str(REPO_ROOT) not in (run_dir / "job.sbatch").read_text()


def test_every_input_path_is_absolute_before_the_job_runs_in_its_run_dir(monkeypatch):
    """The job's working directory is its run directory, so each path a config may give relative
    to where `slurm-align` ran must be made absolute at submission (or the job cannot find it)."""
    monkeypatch.chdir(REPO_ROOT)
    run = load_run_config(REPO_ROOT / "examples" / "grpo_tiny.yaml")
    assert not run.eval.val_path.is_absolute()
    resolved = resolve_input_paths(run)
    for path in (resolved.data.train_path, resolved.eval.val_path):
        assert path.is_absolute() and path.is_file()
    monkeypatch.chdir(REPO_ROOT / "tests")   # from elsewhere the relative path names nothing
    with pytest.raises(ConfigError, match=r"eval\.val_path"):
        resolve_input_paths(run.model_copy(update={"data": resolved.data}))


def test_editable_install_maps_the_top_level_folders(tmp_path):
    """In a checkout's editable install the package data is the charter's top-level folders
    themselves, and a launcher runs by module from any directory."""
    if Path(slurm_align.__file__).resolve().parent != REPO_ROOT / "slurm_align":
        pytest.skip("slurm_align is not installed editable from this checkout")
    assert resources.folder(resources.TEMPLATES).resolve() == REPO_ROOT / "sbatch_templates"
    assert resources.folder(resources.PROFILES).resolve() == REPO_ROOT / "cluster_profiles"
    assert resources.folder(resources.LAUNCHERS).resolve() == REPO_ROOT / "launchers"
    proc = _run([sys.executable, "-m", "slurm_align.launchers.report", "--help"], cwd=tmp_path)
    assert "--run-dir" in proc.stdout
