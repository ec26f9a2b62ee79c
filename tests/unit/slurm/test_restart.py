"""Restart on failure: which failures slurm/restart.py retries, read from a run directory's real
files as the job script and launchers leave them (launcher.log, exit codes, metrics.jsonl,
restarts.jsonl). The resubmission itself runs on the real Slurm cluster in
tests/integration/test_restart.py."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_align.rundir import RunDir
from slurm_align.slurm.restart import decide, with_exclude

KILLED = "srun: error: n3: task 1: Killed\n"


def failed_run(tmp_path: Path, launcher: str, rank1_log: str = "", steps: int = 2,
               restarts: list[dict] = ()) -> RunDir:
    rd = RunDir(tmp_path)
    (rd.logs / "actor").mkdir(parents=True)
    (rd.logs / "actor" / "launcher.log").write_text(launcher)
    (rd.logs / "actor" / "exit_code").write_text("1\n")
    (rd.logs / "actor" / "rank0.log").write_text("step 1\n")
    (rd.logs / "actor" / "rank1.log").write_text(rank1_log)
    rd.first_failure.write_text("actor\n")
    (rd.root / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    (rd.root / "restarts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in restarts))
    return rd


def test_a_killed_rank_is_retried_excluding_its_node(tmp_path):
    entry = decide(failed_run(tmp_path, KILLED), "7", ["actor"], max_restarts=1)
    assert entry.retry and entry.count == 1, entry
    assert (entry.component, entry.rank, entry.nodes, entry.failed_step) == ("actor", 1, ["n3"], 3)


def test_a_second_failure_at_the_same_step_is_not_retried(tmp_path):
    earlier = {"job_id": "7", "retry": True, "failed_step": 3, "nodes": ["n3"], "count": 1}
    entry = decide(failed_run(tmp_path, KILLED.replace("n3", "n1"), restarts=[earlier]), "8", ["actor"],
                   max_restarts=5)
    assert not entry.retry and "at step 3 again" in entry.reason, entry
    # one step further it is a new failure: retried (max_restarts allows it)
    moved = decide(failed_run(tmp_path / "b", KILLED, steps=3, restarts=[earlier]), "8", ["actor"], max_restarts=5)
    assert moved.retry and moved.count == 2, moved


def test_max_restarts_and_python_exceptions_are_not_retried(tmp_path):
    earlier = {"job_id": "7", "retry": True, "failed_step": 1, "nodes": ["n3"], "count": 1}
    entry = decide(failed_run(tmp_path, KILLED, restarts=[earlier]), "8", ["actor"], max_restarts=1)
    assert not entry.retry and "max_restarts=1 reached" in entry.reason, entry
    raised = decide(failed_run(tmp_path / "b", "srun: error: n3: task 1: Exited with exit code 1\n",
                               "Traceback (most recent call last):\nValueError: bad row\n"), "7", ["actor"], 3)
    assert not raised.retry and "not a node's or a signal's doing" in raised.reason, raised


def test_every_hetjob_component_gets_the_exclusion():
    script = ("#!/bin/bash\n#SBATCH --job-name=x\n#SBATCH --nodes=2\n#SBATCH hetjob\n#SBATCH --nodes=1\n"
              "echo body\n")
    out = with_exclude(script, ["n1", "n3"]).splitlines()
    assert out.count("#SBATCH --exclude=n1,n3") == 2
    assert out.index("#SBATCH --exclude=n1,n3", 3) == out.index("#SBATCH hetjob") + 1


def test_a_hung_rank_is_retried_excluding_its_host(tmp_path):
    rd = failed_run(tmp_path, "srun: error: n1: task 0: Exited with exit code 86\n")
    logs = rd.logs / "actor"
    (logs / "hang_rank0.json").write_text(json.dumps(
        {"rank": 0, "phase": "step", "step": 5, "idle_s": 16.0, "timeout_s": 15.0,
         "suspect": {"rank": 1, "phase": "step", "step": 5, "stopped": True}}))
    (logs / "heartbeat_rank1.json").write_text(json.dumps({"rank": 1, "host": "n4", "step": 5}))
    entry = decide(rd, "7", ["actor"], max_restarts=1)
    assert entry.retry and (entry.rank, entry.nodes, entry.failed_step) == (1, ["n4"], 5), entry
    assert "hung rank" in entry.reason
