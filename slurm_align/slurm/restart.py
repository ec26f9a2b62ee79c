"""Restart on failure (`fault_tolerance.max_restarts`): a failed job resubmitted as a new job.

The job script runs `python -m slurm_align.slurm.restart RUN_DIR` after its components ended
and one failed, before it exits 1 (sbatch_templates/_body.sh.j2). The decision is made there,
inside the job, rather than by a watcher on the login node (which would have to stay up for
the whole run) or by Slurm's requeue (which keeps the job id and cannot add `--exclude`):

- retried: a rank killed by a signal (srun/mpirun say so in launcher.log), a hung rank (its
  watchdog's exit 86 and hang report), a node failure srun reported;
- never: a rank that ended with a Python exception (the same input fails again), a failure at
  the very step the previous restart failed at (a poisoned step, not a bad node), more than
  max_restarts restarts per submission, a job that is not the run's recorded Slurm batch job
  (a local or --here run). Submit-time validation failures never reach a job at all.

A retried job is resubmitted from the run directory's own script (job.sbatch) with
`#SBATCH --exclude=` of every node a restart of this submission failed on (srun names the
node of a killed task, a hung rank's last heartbeat its host); the new job resumes from the newest
complete checkpoint as a requeued one does. Each decision, retried or not, is one line of
RUN_DIR/restarts.jsonl (count, job ids, component, rank, reason, failed step, nodes), which
`slurm-align status` shows; job.json then names the new job, so `status`, `cancel` and
`Job.wait` follow it. The failed job's exit codes, first_failure, hang reports and launcher log
are moved aside first, so that the pending new job is not read as failed. A job that is a
pipeline's stage (slurm/pipeline.py) takes its dependents along: their `afterok` is moved onto
the new job while the failed one still runs (once it ends FAILED, Slurm would cancel them), and
pipeline.json records the new id.

A node lost together with the batch script's own node kills the script too: no epilogue runs.
Slurm requeues such a job itself where the profile has `requeue: true` (NODE_FAIL, counted in
max_requeues), without exclusion.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from slurm_align.profiling.watchdog import HUNG_EXIT_CODE, heartbeat_path, read_hang_reports
from slurm_align.rundir import RunDir, write_atomic
from slurm_align.slurm.launch import JobRecord
from slurm_align.slurm.pipeline import follow_restart
from slurm_align.slurm.status import RESTARTS, FailedRank, first_failure, read_restarts

_SRUN_NODE_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-(\d+))?: (.+)")
_NODE_FAILURE = re.compile(r"srun: error: Node failure on (\S+)")
_SIGNALLED = re.compile(r"Killed|[Ss]ignal|exited on signal|Terminated|Aborted|Segmentation")


@dataclass
class Restart:
    """One decision about a failed job (a line of restarts.jsonl)."""

    job_id: str
    retry: bool
    reason: str
    component: str | None = None
    rank: int | None = None
    why: str = ""
    failed_step: int | None = None
    nodes: list[str] = field(default_factory=list)
    """Nodes this failure happened on (excluded from the new job, with the earlier ones)."""
    count: int = 0
    """Restarts of this submission so far, this one included when retried."""
    new_job_id: str | None = None
    dependents: list[str] = field(default_factory=list)
    """A pipeline stage's dependents moved onto the new job (or why one was not)."""
    time: float = field(default_factory=time.time)


def _append(rd: RunDir, entry: Restart) -> None:
    with open(rd.root / RESTARTS, "a") as f:   # one write: lines of two writers never interleave
        f.write(json.dumps(asdict(entry)) + "\n")


def _failed_components(rd: RunDir, components: list[str]) -> list[str]:
    out = []
    for comp in components:
        try:
            if int((rd.logs / comp / "exit_code").read_text().strip()) != 0:
                out.append(comp)
        except (FileNotFoundError, ValueError):
            continue
    return out


def _last_logged_step(rd: RunDir) -> int:
    """The newest step metrics.jsonl holds (rank 0 logs each step once it ended); 0 for none."""
    try:
        lines = (rd.root / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip()]
    return max(steps, default=0)


def classify(rd: RunDir, failed: FailedRank) -> tuple[bool, str, list[str], int]:
    """(retry?, the kind of failure, its nodes, the step in flight) for the first failure."""
    comp_logs = rd.logs / failed.component
    hangs = read_hang_reports(comp_logs)
    if hangs:
        sus = hangs[0].get("suspect") or hangs[0]
        try:   # the stuck rank's host: its last heartbeat says it
            host = json.loads(heartbeat_path(comp_logs, int(sus["rank"])).read_text()).get("host")
        except (OSError, ValueError):
            host = None
        nodes = [host] if host else []
        return True, f"hung rank (watchdog exit {HUNG_EXIT_CODE})", nodes, int(sus.get("step") or
                                                                              _last_logged_step(rd) + 1)
    step = _last_logged_step(rd) + 1
    if failed.rank is None:   # a pre-flight failure ends the script before this runs; anything else
        return False, "no rank named (see the launcher's log)", [], step
    launcher = comp_logs / "launcher.log"
    text = launcher.read_text(errors="replace") if launcher.is_file() else ""
    lost = sorted(set(_NODE_FAILURE.findall(text)))
    if lost:
        return True, "node failure", lost, step
    if failed.why == "Python exception" or (_SIGNALLED.search(failed.why) is None):
        return False, f"rank {failed.rank} failed with {failed.why!r}: not a node's or a signal's doing", [], step
    nodes = []
    for m in _SRUN_NODE_TASK.finditer(text):
        first, last = int(m.group(2)), int(m.group(3) or m.group(2))
        if first <= failed.rank <= last:
            nodes.append(m.group(1))
            break
    return True, f"rank {failed.rank} {failed.why}", nodes, step


def decide(rd: RunDir, job_id: str, components: list[str], max_restarts: int) -> Restart:
    """Whether the failed job `job_id` is resubmitted (nothing is changed here)."""
    failed = first_failure(rd, rd.first_failed_component(), _failed_components(rd, components))
    if failed is None:
        return Restart(job_id, False, "no failed component recorded")
    retry, kind, nodes, step = classify(rd, failed)
    earlier = [r for r in read_restarts(rd) if r.get("retry")]
    entry = Restart(job_id, False, kind, failed.component, failed.rank, failed.why, step, nodes, len(earlier))
    if not retry:
        entry.reason = f"not retried: {kind}"
    elif len(earlier) >= max_restarts:
        entry.reason = f"not retried: {kind}; max_restarts={max_restarts} reached"
    elif earlier and earlier[-1].get("failed_step") == step:
        entry.reason = (f"not retried: {kind} at step {step} again (the previous restart failed at the same "
                        "step: the step itself fails, not a node)")
    else:
        entry.retry, entry.count, entry.reason = True, len(earlier) + 1, f"retried: {kind}"
    return entry


def excluded_nodes(rd: RunDir, entry: Restart) -> list[str]:
    """Every node a retried failure of this submission happened on, this one's included."""
    nodes = {n for r in read_restarts(rd) if r.get("retry") for n in r.get("nodes", [])}
    return sorted(nodes | set(entry.nodes))


def with_exclude(script: str, nodes: list[str]) -> str:
    """The job script with `#SBATCH --exclude=` for the first component and after each
    `#SBATCH hetjob` (a hetjob's options hold per component)."""
    if not nodes:
        return script
    flag = f"#SBATCH --exclude={','.join(nodes)}"
    lines, out, first_done = script.splitlines(), [], False
    for line in lines:
        out.append(line)
        if (not first_done and line.startswith("#SBATCH --job-name=")) or line.strip() == "#SBATCH hetjob":
            out.append(flag)
            first_done = True
    return "\n".join(out) + "\n"


def _set_aside(rd: RunDir, components: list[str], job_id: str) -> None:
    """The failed job's traces that would make the pending new job read as failed: renamed
    beside the logs with the job id (kept for post-mortems)."""
    aside = rd.logs / f"failed-{job_id}"
    aside.mkdir(parents=True, exist_ok=True)
    if rd.first_failure.exists():
        os.replace(rd.first_failure, aside / "first_failure")
    for comp in components:
        (aside / comp).mkdir(exist_ok=True)
        for pattern in ("exit_code", "launcher.log", "hang_rank*.json", "stacks_rank*.txt", "heartbeat_rank*.json"):
            for path in (rd.logs / comp).glob(pattern):
                os.replace(path, aside / comp / path.name)


def _submit_env() -> dict[str, str]:
    """This job's environment without Slurm's variables for it (SLURM_JOB_ID, SLURM_RESTART_COUNT,
    ... would be inherited by the new job and misread; SLURM_CONF still names the cluster)."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
                    and not k.startswith("SLURM_ALIGN_") and k != "SLURM_CONF")}


def restart(run_dir: Path) -> Restart | None:
    """Decide and, when retried, resubmit. None when this is not the run's recorded Slurm job."""
    rd = RunDir(Path(run_dir))
    record = JobRecord.load(rd.root)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if record.backend != "slurm" or record.job_id != job_id:
        return None
    run = yaml.safe_load(rd.config.read_text())
    max_restarts = int((run.get("fault_tolerance") or {}).get("max_restarts", 0))
    if not max_restarts:
        return None
    entry = decide(rd, job_id, record.components, max_restarts)
    if entry.retry:
        nodes = excluded_nodes(rd, entry)
        script = rd.root / "job_restart.sbatch"
        write_atomic(script, with_exclude(rd.script.read_text(), nodes))
        _set_aside(rd, record.components, job_id)
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              env=_submit_env(), cwd=rd.root)
        if done.returncode != 0:
            entry.retry, entry.count = False, entry.count - 1
            entry.reason = f"not retried: sbatch failed ({done.stderr.strip() or done.returncode})"
        else:
            entry.new_job_id = done.stdout.strip().split(";")[0]
            entry.reason += f"; new job {entry.new_job_id} excludes {','.join(nodes) or 'no node'}"
            # Before this job ends: its end as FAILED would make Slurm cancel them.
            entry.dependents = follow_restart(rd.root, job_id, entry.new_job_id, env=_submit_env())
    _append(rd, entry)
    if entry.new_job_id is not None:   # after the line: whoever follows job.json finds the reason
        record.job_id, record.after = entry.new_job_id, []
        record.save()
    return entry


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    entry = restart(Path(args[0]))
    if entry is not None:
        print(f"slurm-align: restart on failure: {entry.reason}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
