"""Submit for real: a hetjob on the local Slurm cluster, and the same launchers on the `local` profile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.config.errors import ConfigError
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
def test_a_cancelled_job_reads_cancelled_whatever_exit_code_its_ranks_left(slurm_cluster, tmp_path):
    """The cancel's SIGTERM ends the ranks with non-zero codes, and the job script may write them
    before its TERM trap runs (the race behind a CI failure: FAILED read for a cancel). A real
    job, the race's outcome written by hand: while Slurm runs the job a non-zero code still
    means FAILED at once; once Slurm says CANCELLED, the job is CANCELLED."""
    from slurm_align.slurm.launch import Job, JobRecord
    sub = slurm_cluster.run("sbatch", "--parsable", "-p", slurm_cluster.partition, "-o", "/dev/null",
                            "--wrap", "sleep 300")
    job_id = sub.stdout.strip().split(";")[0]
    run_dir = tmp_path / "run"
    (run_dir / "logs" / "actor").mkdir(parents=True)
    job = Job(JobRecord("slurm", job_id, str(run_dir), ["actor"], "local-slurm"))
    deadline = time.monotonic() + 120
    while job.state() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job_id} did not start: {job.state()}"
        time.sleep(0.2)
    (run_dir / "logs" / "actor" / "exit_code").write_text("143\n")
    assert job.state() == "FAILED"   # a component's failure is known before Slurm tears down
    slurm_cluster.run("scancel", job_id)
    assert job.wait(timeout_s=60, poll_s=0.2) == "CANCELLED"


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
    # rank 2 only lost its peer (a gloo error) and happened to be listed first: rank 0 died
    ("srun: error: n2: task 2: Exited with exit code 1\nsrun: error: n1: task 0: Killed\n", 0, "Killed"),
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
        if r == 2:
            text += ("Traceback (most recent call last):\nRuntimeError: [gloo/transport/tcp/pair.cc:537] Read error "
                     "[127.0.0.1]:19855: Connection reset by peer.\n")
        (logs / f"rank{r}.log").write_text(text)
    failed = failing_rank(rd, "critic", lines=2)
    assert (failed.component, failed.rank, failed.why) == ("critic", rank, why)
    log = logs / f"rank{rank}.log"
    assert failed.log == log and failed.tail == log.read_text().splitlines()[-2:]


@pytest.mark.parametrize("peer,lost", [
    ("generator", "slurm_align.generation.stream.StreamClosed: the peer closed the stream"),
    # the critic's server went with its rank 0 (a timeout: it hung on the dead rank's collective)
    ("critic", "slurm_align.critic.client.CriticError: critic at 127.0.0.1:43327, endpoint critic_infer: "
               "request failed after 0.0 s (request_timeout_s=300): ConnectionRefusedError: [Errno 111] "
               "Connection refused"),
    ("critic", "slurm_align.critic.client.CriticError: critic at 127.0.0.1:43327, endpoint critic_train: "
               "request failed after 300.1 s (request_timeout_s=300): timeout: timed out"),
    # the critic's server answered with an error: its own collective failed on the dead rank
    ("critic", "slurm_align.critic.client.CriticError: critic at 127.0.0.1:43327, endpoint critic_train: "
               "Unexpected error in the inference callable: RuntimeError: rank 1 did not answer"),
], ids=["stream", "critic-refused", "critic-timeout", "critic-server-error"])
def test_status_names_the_component_whose_rank_died_not_the_one_that_lost_it(tmp_path, peer, lost):
    """As in CI runs: a rank of the generator (or critic) was killed, the actor (reading its
    stream, or calling the critic) failed for that and its srun returned first, so the job
    script wrote actor to first_failure."""
    from slurm_align.rundir import RunDir
    from slurm_align.slurm.status import first_failure

    rd = RunDir(tmp_path)
    for comp, launcher, logs in [
        ("actor", "srun: error: n1: task 0: Exited with exit code 1\n",
         {0: f"Traceback (most recent call last):\n  File \"x.py\", line 76, in f\n{lost}\n"}),
        (peer, "srun: error: n2: task 1: Killed\nsrun: error: n2: task 0: Killed\n",
         {0: "working\n", 1: "working\n"}),
    ]:
        (rd.logs / comp).mkdir(parents=True)
        (rd.logs / comp / "launcher.log").write_text(launcher)
        for r, text in logs.items():
            (rd.logs / comp / f"rank{r}.log").write_text(text)
    failed = first_failure(rd, "actor", ["actor", peer])
    assert (failed.component, failed.rank, failed.why) == (peer, 1, "Killed")
    # the actor's own failure (not a lost peer) stays the one named
    (rd.logs / "actor" / "rank0.log").write_text("Traceback (most recent call last):\nValueError: boom\n")
    failed = first_failure(rd, "actor", ["actor", peer])
    assert (failed.component, failed.rank) == ("actor", 0)
    assert first_failure(rd, None, []) is None


def test_status_passes_over_a_rank_killed_by_the_teardown_of_the_job(tmp_path):
    """As in a CI run of the three-component hetjob: generator rank 1 was killed, the actor lost
    its stream and ended first, then the job script's teardown killed the critic's rank 0, whose
    srun names it after "forcing job termination". The generator's rank is the cause."""
    from slurm_align.rundir import RunDir
    from slurm_align.slurm.status import failing_rank, first_failure

    rd = RunDir(tmp_path)
    launchers = {
        "actor": "srun: Job step aborted: Waiting up to 4 seconds for job step to finish.\n"
                 "slurmstepd-n1: error: *** STEP 5.3 ON n1 CANCELLED AT 2026-12-03T13:38:26 ***\n"
                 "srun: error: n1: task 0: Exited with exit code 1\n",
        "critic": "srun: forcing job termination\n"
                  "srun: Job step aborted: Waiting up to 4 seconds for job step to finish.\n"
                  "slurmstepd-n2: error: *** STEP 6.4 ON n2 CANCELLED AT 2026-12-03T13:38:26 ***\n"
                  "srun: error: n2: task 0: Killed\n",
        "generator": "srun: error: n3: task 1: Killed\n"
                     "slurmstepd-n3: error: *** STEP 7.5 ON n3 CANCELLED AT 2026-12-03T13:38:24 ***\n"
                     "srun: forcing job termination\n"
                     "srun: error: n3: task 0: Killed\n",
    }
    for comp, text in launchers.items():
        (rd.logs / comp).mkdir(parents=True)
        (rd.logs / comp / "launcher.log").write_text(text)
        for r in (0, 1) if comp == "generator" else (0,):
            (rd.logs / comp / f"rank{r}.log").write_text("working\n")
    (rd.logs / "actor" / "rank0.log").write_text(
        "Traceback (most recent call last):\nslurm_align.generation.stream.StreamClosed: the peer closed the stream\n")
    assert failing_rank(rd, "critic").torn_down and not failing_rank(rd, "generator").torn_down
    failed = first_failure(rd, "actor", ["actor", "critic", "generator"])
    assert (failed.component, failed.rank, failed.why) == ("generator", 1, "Killed")


@pytest.mark.parametrize("slurm,codes,first,expected", [
    # CI: the critic failed (exit 3); the script's stop of the actor left Slurm's record of the
    # critic's component CANCELLED
    (["FAILED", "CANCELLED"], {"actor": 137, "critic": 3}, "critic", {"actor": "FAILED", "critic": "FAILED"}),
    # scancel: a rank ended by the TERM before the script's trap ran is named, but the whole
    # job is CANCELLED
    (["CANCELLED", "CANCELLED"], {"actor": 143, "critic": 143}, "actor", {"actor": "CANCELLED", "critic": "CANCELLED"}),
    # Slurm still ending the job: not final yet
    (["COMPLETING", "COMPLETING"], {"actor": 143, "critic": None}, "actor", {"actor": "RUNNING", "critic": "RUNNING"}),
], ids=["failure-then-stop", "cancel", "completing"])
def test_the_component_the_script_saw_fail_first_is_failed_unless_the_job_was_cancelled(
        tmp_path, monkeypatch, slurm, codes, first, expected):
    """Component states read from the run directory and Slurm's per-component states (given
    here: the real ones are read in the Slurm tests of this file and integration/test_failures.py)."""
    from slurm_align.slurm import state as job_state
    from slurm_align.slurm.launch import Job, JobRecord

    monkeypatch.setattr(job_state, "slurm_state",
                        lambda job_id: (job_state.combine([job_state.fold(s) for s in slurm]), slurm))
    job = Job(JobRecord("slurm", "7", str(tmp_path), ["actor", "critic"], "local-slurm"))
    for comp, code in codes.items():
        (job.run_dir.logs / comp).mkdir(parents=True)
        (job.run_dir.logs / comp / "rank0.log").write_text("log\n")
        if code is not None:
            (job.run_dir.logs / comp / "exit_code").write_text(f"{code}\n")
    job.run_dir.first_failure.write_text(f"{first}\n")
    assert job.component_states() == expected
    assert sorted(job.failed_logs()) == sorted(c for c, s in expected.items() if s == "FAILED")


def _scontrol_fields(job_id: str, name: str) -> list[str]:
    """A field of every component of a job, as Slurm stored it (`scontrol show job`)."""
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout
    # a field runs to the next " Key=" on its line (the values here hold no such text)
    return [m.group(1).rstrip() for m in re.finditer(rf"(?m)^\s*{name}=(.*?)(?= [A-Z][A-Za-z/:]*=|$)", text)]


@pytest.mark.slurm
def test_sbatch_reads_values_back_exactly(slurm_cluster, tmp_path):
    """Free-text #SBATCH values (features with & | [], a comment with spaces and #) reach Slurm
    unchanged: submitted held (never run) and read back with scontrol."""
    comment = "two words # and a 'quote' \"too\""
    prof = load_profile("local-slurm", [
        "components.actor.sbatch_extra.constraint=gpu&hbm80g",
        "components.critic.sbatch_extra.constraint='[rack1|rack2]'",
        f"sbatch_extra.comment={json.dumps(comment)}", "sbatch_extra.hold=''"])
    job = launch_run(load_run_config(EXAMPLE), prof, tmp_path / "run", entry=Entry("report"))
    try:
        assert _scontrol_fields(job.job_id, "Features") == ["gpu&hbm80g", "[rack1|rack2]"]
        assert _scontrol_fields(job.job_id, "Comment") == [comment, comment]
    finally:
        subprocess.run(["scancel", job.job_id], check=False)


def test_injection_through_the_run_dir_is_refused_and_nothing_submitted(tmp_path):
    """`--run-dir $'/tmp/x\\ntouch /tmp/PWNED #'` once rendered a script line; now submit refuses it,
    names the field and the value, writes nothing and never calls sbatch (a fake one records calls)."""
    env, calls = _fake_sbatch(tmp_path)
    pwned = tmp_path / "PWNED"
    run_dir = f"{tmp_path}/x\ntouch {pwned} #"
    proc = subprocess.run([sys.executable, "-m", "slurm_align.cli", "submit", str(EXAMPLE), "--profile", "local-slurm",
                           "--run-dir", run_dir, "--entry", "report"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode != 0
    msg = " ".join((proc.stdout + proc.stderr).split())
    assert "--run-dir" in msg and "control characters" in msg and "touch" in msg, msg
    assert not calls.exists() and not pwned.exists()
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


# --- which profile, and paths the compute nodes must see ------------------------------------------
def _fake_sbatch(tmp_path: Path) -> tuple[dict, Path]:
    """PATH with an sbatch that only records that it was called (nothing may reach it)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    calls = tmp_path / "sbatch_calls"
    (fake / "sbatch").write_text(f"#!/bin/sh\necho called >> {calls}\necho 1\n")
    (fake / "sbatch").chmod(0o755)
    return {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}, calls


def test_hostname_pattern_picks_the_profile(tmp_path, monkeypatch):
    from slurm_align.slurm.choose import choose_profile

    mine = tmp_path / "profiles"
    mine.mkdir()
    (mine / "bigiron.yaml").write_text("kind: slurm\npartition: gpu\nhostname_pattern: '^login[0-9]+\\.bigiron\\.'\n")
    monkeypatch.setenv("SLURM_ALIGN_PROFILE_PATH", str(mine))
    assert choose_profile(None, hostname="login3.bigiron.example.org", has_sbatch=True).name == "bigiron"
    assert choose_profile(None, hostname="laptop", has_sbatch=False).name == "local"
    assert choose_profile("local-slurm", hostname="login3.bigiron.example.org").name == "local-slurm"
    with pytest.raises(ConfigError) as info:
        choose_profile(None, hostname="login3.othercluster", has_sbatch=True)
    msg = str(info.value)
    assert "'--profile'" in msg and "login3.othercluster" in msg and "(login) node" in msg
    assert "bigiron" in msg and "local-slurm" in msg   # the profiles to choose from


def test_submit_without_profile_on_a_slurm_machine_is_refused(tmp_path):
    env, calls = _fake_sbatch(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "slurm_align.cli", "submit", str(EXAMPLE), "--run-dir",
                           str(tmp_path / "run"), "--entry", "report"], capture_output=True, text=True, env=env,
                          timeout=120)
    msg = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, msg
    assert "hostname_pattern" in msg and "available: " in msg and "local-slurm" in msg, msg
    assert not calls.exists() and not (tmp_path / "run").exists()


def test_slurm_profile_refuses_node_local_run_dir_and_interpreter(tmp_path):
    """tmp_path is under /tmp: fine for the one-host test cluster (shared_tmp: true), refused for a
    Slurm profile without it, naming the field, the value and the reason, before anything is written."""
    prof = load_profile("local-slurm", ["shared_tmp=false", "python=/tmp/venv/bin/python"])
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        launch_run(load_run_config(EXAMPLE), prof, run_dir, entry=Entry("report"))
    msg = str(info.value)
    assert "'--run-dir'" in msg and str(run_dir) in msg and "each node's own" in msg
    assert "'python'" in msg and "/tmp/venv/bin/python" in msg and "shared_tmp" in msg
    assert not run_dir.exists()


def test_run_root_holds_new_run_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("I19_SCRATCH", str(tmp_path / "scratch"))
    proc = _cli("render", str(EXAMPLE), "--profile", "local-slurm", "-P", "run_root=$I19_SCRATCH/slurm-align")
    assert proc.returncode == 0, proc.stderr
    assert f"for run {tmp_path}/scratch/slurm-align/ppo-" in proc.stdout
    monkeypatch.delenv("I19_SCRATCH")
    proc = _cli("render", str(EXAMPLE), "--profile", "local-slurm", "-P", "run_root=$I19_SCRATCH/slurm-align")
    assert proc.returncode == 2 and "run_root" in proc.stderr and "not set" in proc.stderr, proc.stderr


def test_network_interface_gives_the_critic_and_rendezvous_address(monkeypatch):
    """profile network.interface: the job script exports it (and NCCL/GLOO_SOCKET_IFNAME); the critic
    binds to that interface's address and torch's rendezvous advertises it; a name the node does
    not have is refused listing the interfaces it has."""
    from slurm_align.config.run import RunConfig
    from slurm_align.critic.main import bind_host
    from slurm_align.parallel.bootstrap import INTERFACE_ENV, BootstrapError, _local_address, interface_address

    text = _render_with(["network.interface=lo"])
    assert "export SLURM_ALIGN_NET_IFNAME=lo\nexport NCCL_SOCKET_IFNAME=lo\nexport GLOO_SOCKET_IFNAME=lo\n" in text
    assert interface_address("lo") == "127.0.0.1"
    monkeypatch.setenv(INTERFACE_ENV, "lo")
    assert bind_host(RunConfig()) == "127.0.0.1" and _local_address(multi_node=True) == "127.0.0.1"
    assert bind_host(RunConfig(critic_server={"bind_host": "127.0.0.2"})) == "127.0.0.2"   # explicit wins
    with pytest.raises(BootstrapError, match=r"'nosuch0'.*this node has: .*lo 127.0.0.1"):
        interface_address("nosuch0")


def _render_with(profile_set: list[str]) -> str:
    from slurm_align.slurm.render import render_script

    return render_script(load_run_config(EXAMPLE), load_profile("local-slurm", profile_set), Path("/scratch/r"),
                         Entry("report"))


@pytest.mark.slurm
def test_preflight_fails_the_job_at_once_naming_node_and_reason(slurm_cluster, tmp_path):
    """An interpreter that does not exist on the compute nodes: the pre-flight step fails the job
    before any rank starts (bounded: well within the component's hold), and `status` names the
    component, the node and the reason."""
    run_dir = tmp_path / "run"
    hold = Entry("report", {"actor": ["--hold-s", "300"], "critic": ["--hold-s", "300"]})
    prof = load_profile("local-slurm", ["python=/nonexistent/venv/bin/python"])
    job = launch_run(load_run_config(EXAMPLE), prof, run_dir, entry=hold)
    assert job.wait(timeout_s=120, poll_s=0.5) == "FAILED"
    status = json.loads(_cli("status", str(run_dir), "--json").stdout)
    failed = status["failed"]
    assert failed["component"] == "actor" and failed["rank"] is None, status
    assert "pre-flight failed on node n" in failed["why"] and "/nonexistent/venv/bin/python" in failed["why"], failed
    assert "cannot import slurm_align" in failed["why"]
    assert not (run_dir / "reports").exists(), "no rank may start after a failed pre-flight"
    text = _cli("status", str(run_dir)).stdout
    assert "actor failed first" in " ".join(text.split()) and "before any rank started" in " ".join(text.split())


@pytest.mark.slurm
@pytest.mark.slow
def test_single_allocation_shape_runs_tiny_ppo_to_completion(slurm_cluster, tmp_path):
    """job_shape single: one plain job (no hetjob) of 3 nodes; the actor's 2 ranks and the critic
    run as sruns on disjoint node sets of it, find each other as in a hetjob, and the tiny PPO
    completes with every step stored."""
    from slurm_align.store.rollouts import RolloutStore
    from tests.integration.test_ppo import check_complete_run, tiny_run

    run_dir = tmp_path / "run"
    job = launch_run(tiny_run(), load_profile("local-slurm", ["job_shape=single"]), run_dir)
    script = (run_dir / "job.sbatch").read_text()
    state = job.wait(timeout_s=600, poll_s=0.5)
    assert state == "COMPLETED", "\n".join(p.read_text()[-2000:] for p in (run_dir / "logs").rglob("*.log"))
    assert "#SBATCH hetjob" not in script and "--het-group" not in script
    assert RolloutStore.open(run_dir / "rollouts.zarr", read_only=True).steps.tolist() == [1, 2]
    # every sample of every step, spans and metrics: work stealing over the actor's 2 DP ranks
    check_complete_run(run_dir, steps=2, samples=8, actor_ranks=2)
    assert 'srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist="$SLURM_ALIGN_NODELIST_0"' in script


@pytest.mark.slurm
def test_submit_here_runs_a_tiny_ppo_inside_an_salloc_allocation(slurm_cluster, tmp_path):
    """`submit --here` inside `salloc`: the components run as srun steps of that allocation (no
    new job), with the run directory, logs and status of a batch job."""
    run_dir = tmp_path / "run"
    prompts = REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl"
    cmd = [sys.executable, "-m", "slurm_align.cli", "submit", str(EXAMPLE), "--profile", "local-slurm",
           "--run-dir", str(run_dir), "--here", f"data.train_path={prompts}", "ppo.num_steps=1",
           "ppo.num_rollout_samples=4", "generation.max_new_tokens=4", "generation.prompt_batch_size=2",
           "ppo.train_micro_batch_size=2"]
    proc = subprocess.run(["salloc", "-N", "3", "-p", slurm_cluster.partition, *cmd], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    alloc = re.search(r"Granted job allocation (\d+)", proc.stderr)
    assert alloc, proc.stderr
    record = json.loads((run_dir / "job.json").read_text())
    assert record["backend"] == "here" and record["job_id"].startswith(f"{alloc.group(1)}-here-")
    for comp, ranks in (("actor", 2), ("critic", 1)):
        for rank in range(ranks):
            assert (run_dir / "logs" / comp / f"rank{rank}.log").is_file()
    assert json.loads(_cli("status", str(run_dir), "--json").stdout)["state"] == "COMPLETED"
    assert (run_dir / "checkpoints" / "actor" / "iter_0000001" / "manifest.json").is_file()
    jobs = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout.split()
    # the ranks ran as steps of the allocation: no job was submitted after it
    assert all(int(j.split("+")[0]) <= int(alloc.group(1)) for j in jobs), jobs
