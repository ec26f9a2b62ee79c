"""Submit for real: a hetjob on the local Slurm cluster, and the same launchers on the `local` profile."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.render import Entry

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


def _reports(run_dir: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (run_dir / "reports").glob("*/rank*.json")),
                  key=lambda r: (r["component"], r["rank"]))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_align.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _check_hetjob_report(reports: list[dict], actor_ranks: int, distinct_hosts: bool) -> None:
    by_comp = {c: [r for r in reports if r["component"] == c] for c in ("actor", "critic")}
    assert [r["rank"] for r in by_comp["actor"]] == list(range(actor_ranks))
    assert [r["rank"] for r in by_comp["critic"]] == [0]
    for r in reports:
        assert r["size"] == (actor_ranks if r["component"] == "actor" else 1)   # one MPI world per component
        assert r["ntasks"] == {"actor": actor_ranks, "critic": 1}
        assert r["host"] in r["hosts"][r["component"]]
    critic_host = by_comp["critic"][0]["host"]
    for r in by_comp["actor"]:  # every actor rank knows where the critic is
        assert r["hosts"]["critic"] == [critic_host]
        assert r["addresses"]["critic"] == "127.0.0.1"
    if distinct_hosts:  # hetjob components never share a node; the actor spans 2 nodes
        actor_hosts = {r["host"] for r in by_comp["actor"]}
        assert len(actor_hosts) == actor_ranks and critic_host not in actor_hosts


def test_local_profile_runs_the_launchers(tmp_path):
    run = load_run_config(EXAMPLE)
    job = launch_run(run, load_profile("local"), tmp_path / "run", entry=Entry("report"))
    assert job.wait(timeout_s=120) == "COMPLETED"
    _check_hetjob_report(_reports(tmp_path / "run"), actor_ranks=2, distinct_hosts=False)
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert (tmp_path / "run" / "logs" / "actor" / "rank1.log").is_file()


def test_local_component_crash_fails_fast(tmp_path):
    run = load_run_config(EXAMPLE)
    # The actor holds far longer than the wait's ceiling: FAILED within it means the crash was
    # seen without waiting for the actor (no timed assertion: the ceiling is for a loaded machine).
    entry = Entry("report", {"critic": ["--fail-rank", "0"], "actor": ["--hold-s", "3600"]})
    job = launch_run(run, load_profile("local"), tmp_path / "run", entry=entry)
    assert job.wait(timeout_s=300) == "FAILED"
    logs = job.failed_logs()
    assert "critic" in logs and logs["critic"][0].name == "rank0.log"


@pytest.mark.slurm
def test_hetjob_on_real_slurm(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = _cli("submit", str(EXAMPLE), "--profile", "local-slurm", "--run-dir", str(run_dir),
                "--entry", "report", "--follow", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((run_dir / "job.json").read_text())
    assert record["backend"] == "slurm" and record["job_id"] in proc.stdout
    _check_hetjob_report(_reports(run_dir), actor_ranks=2, distinct_hosts=True)
    status = json.loads(_cli("status", str(run_dir), "--json").stdout)
    assert {k: status[k] for k in ("job_id", "state", "components", "requeues", "failed")} == {
        "job_id": record["job_id"], "state": "COMPLETED", "components": {"actor": "COMPLETED", "critic": "COMPLETED"},
        "requeues": 0, "failed": None}
    # the local profile gives the same report, apart from the hosts
    local = launch_run(load_run_config(EXAMPLE), load_profile("local"), tmp_path / "local", entry=Entry("report"))
    assert local.wait(timeout_s=120) == "COMPLETED"
    strip = lambda rs: [{k: r[k] for k in ("component", "rank", "size", "ntasks")} for r in rs]  # noqa: E731
    assert strip(_reports(tmp_path / "local")) == strip(_reports(run_dir))


@pytest.mark.slurm
def test_status_and_cancel_on_real_slurm(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    hold = Entry("report", {"actor": ["--hold-s", "300"], "critic": ["--hold-s", "300"]})
    job = launch_run(load_run_config(EXAMPLE), load_profile("local-slurm"), run_dir, entry=hold)
    deadline = time.monotonic() + 300   # a ceiling for a loaded 2-core machine, not a speed bound
    while not all((run_dir / "reports" / c / "rank0.json").exists() for c in ("actor", "critic")):
        assert time.monotonic() < deadline, "the job did not start within 300 s"
        time.sleep(0.5)
    status = _cli("status", str(run_dir), "--json")
    assert json.loads(status.stdout)["state"] == "RUNNING", status.stdout
    cancel = _cli("cancel", job.job_id)   # by job id, as a user would
    assert cancel.returncode == 0, cancel.stderr
    assert job.wait(timeout_s=60) == "CANCELLED"


@pytest.mark.slurm
def test_component_crash_on_real_slurm_is_failed_with_logs(slurm_cluster, tmp_path):
    run = load_run_config(EXAMPLE)
    # As on the local profile: the actor's hold is far past the wait's ceiling.
    entry = Entry("report", {"critic": ["--fail-rank", "0"], "actor": ["--hold-s", "3600"]})
    job = launch_run(run, load_profile("local-slurm"), tmp_path / "run", entry=entry)
    assert job.wait(timeout_s=300) == "FAILED"
    logs = job.failed_logs()
    assert "critic" in logs and logs["critic"] and logs["critic"][0].is_file()
    assert "fails on purpose" in logs["critic"][0].read_text()


@pytest.mark.parametrize("launcher,rank,why", [
    ("srun: error: n2: task 1: Killed\nsrun: error: n1: task 0: Exited with exit code 1\n", 1, "Killed"),
    ("mpirun noticed that process rank 2 with PID 4242 on node host exited on signal 9 (Killed).\n", 2,
     "exited on signal 9 (Killed)"),
    ("", 1, "Python exception"),   # nothing from the launcher: the rank whose log has a traceback
])
def test_status_names_the_rank_that_failed_first(tmp_path, launcher, rank, why):
    from slurm_align.rundir import RunDir
    from slurm_align.slurm.status import failing_rank

    rd = RunDir(tmp_path)
    logs = rd.logs / "critic"
    logs.mkdir(parents=True)
    (logs / "launcher.log").write_text(launcher)
    for r in range(3):
        text = f"rank {r} working\n" + ("Traceback (most recent call last):\nValueError: boom\n" if r == 1 else "")
        (logs / f"rank{r}.log").write_text(text)
    failed = failing_rank(rd, "critic", lines=2)
    assert (failed.component, failed.rank, failed.why) == ("critic", rank, why)
    assert failed.log == logs / f"rank{rank}.log" and failed.tail == (logs / f"rank{rank}.log").read_text().splitlines()[-2:]
