"""Preemption on a real Slurm cluster: how long from Slurm's signal to a saved checkpoint, to the
job requeued, and from the requeue to the first new step; and how much work was lost.

Runs the tiny PPO hetjob (actor 2 ranks on 2 nodes, critic 1 rank) with `requeue: true` on the
local test cluster that SLURM_CONF points at, in one or both ways a job is stopped:
- usr2: the batch script gets USR2 (as `--signal=B:USR2@grace` sends it) once a step is done; the
  stop point finishes the step in flight and saves it, so work lost is at most that step;
- slurm: Slurm's own partition-priority preemption: the job runs on `preemptible`
  (PreemptMode=REQUEUE, GraceTime), and once a step is done a job on `urgent` asks for its
  nodes; Slurm TERMs every step. With --grace (preempt_grace_s, default 60: the partition's
  GraceTime) the actor finishes the step in flight and saves it when it fits (nothing lost);
  with --grace 0 it stops at once at its newest checkpoint (save_interval 1) and the step in
  flight is lost and redone. The signal time is the urgent job's submission.
The stages' times come from RUN_DIR/preemption.jsonl; lost_steps counts steps begun after the
saved one (their spans, read before the requeued job starts). The last line is the slurm mode's.

    python -m tests.cluster up --workdir /tmp/sa-cluster   # prints export SLURM_CONF=...
    python benchmarks/bench_preempt.py [--steps 4] [--mode usr2|slurm|both] [--grace 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from slurm_align import REPO_ROOT
from slurm_align.config import load_profile, load_run_config
from slurm_align.rundir import RunDir
from slurm_align.slurm.launch import launch_run
from slurm_align.slurm.preemption import read_events
from slurm_align.store.traces import read_traces

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"
PROMPTS = REPO_ROOT / "examples" / "synthetic" / "prompts.jsonl"


def wait_event(rd: RunDir, kind: str, count: int = 1, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_events(rd) if e["event"] == kind]
        if len(found) >= count:
            return found[count - 1]
        time.sleep(0.05)
    raise TimeoutError(f"no {kind!r} event #{count} in {rd.preemption_events} after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None, help="run directory parent (default: a temp folder)")
    ap.add_argument("--mode", choices=["usr2", "slurm", "both"], default="both",
                    help="the script's USR2 warning, Slurm's own partition preemption, or both (slurm last)")
    ap.add_argument("--grace", type=int, default=60,
                    help="slurm mode: the profile's preempt_grace_s (0: stop at once, the step in flight is redone)")
    args = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("SLURM_CONF is not set: start the local test cluster with "
                         "`python -m tests.cluster up` and export the SLURM_CONF it prints")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-preempt-"))
    run = load_run_config(EXAMPLE, [f"data.train_path={PROMPTS}", f"ppo.num_steps={args.steps}",
                                    "ppo.num_rollout_samples=8", "generation.max_new_tokens=8",
                                    "generation.prompt_batch_size=2", "ppo.train_micro_batch_size=2"])
    for mode in (["usr2", "slurm"] if args.mode == "both" else [args.mode]):
        measure(run, mode, RunDir(out / f"run-{mode}"), args.grace)


def _job_nodes(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                         check=True, timeout=30).stdout.split()
    hosts = subprocess.run(["scontrol", "show", "hostnames", ",".join(out)], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split()
    return ",".join(sorted(set(hosts)))


def measure(run, mode: str, rd: RunDir, grace: int = 60) -> None:
    if mode == "usr2":
        job = launch_run(run, load_profile("local-slurm", ["requeue=true"]), rd.root)
        wait_event(rd, "first_step")
        t_signal = time.time()
        subprocess.run(["scancel", "--signal=USR2", "--batch", job.job_id], check=True, timeout=30)
    else:
        run = run.model_copy(update={"ppo": run.ppo.model_copy(update={"save_interval": 1})})
        profile = load_profile("local-slurm", ["partition=preemptible", "requeue=true", f"preempt_grace_s={grace}"])
        job = launch_run(run, profile, rd.root)
        wait_event(rd, "first_step")
        nodes = _job_nodes(job.job_id)
        t_signal = time.time()
        subprocess.run(["sbatch", "-p", "urgent", "--exclusive", "-N", str(len(nodes.split(","))),
                        f"--nodelist={nodes}", "-o", str(rd.root.parent / "urgent-%j.out"), "--wrap", "sleep 1"],
                       check=True, timeout=30, capture_output=True)
    saved = wait_event(rd, "saved")
    spans = read_traces(rd.traces).spans   # before the requeued job cuts the stores back
    begun_after = {int(s) for s in spans["step"][spans["component"] == "actor"] if s > saved["step"]}
    requeued = wait_event(rd, "requeued")
    first_new = wait_event(rd, "first_step", count=2)
    final = job.wait(timeout_s=900, poll_s=0.5)
    if final != "COMPLETED":
        raise SystemExit(f"job {job.job_id} ended {final}; logs in {rd.logs}")
    print(f"[{mode}] run {rd.root}: stopped after step {saved['step']}, resumed at {first_new['step']}")
    print(f"signal_to_saved_s={saved['time'] - t_signal:.2f} "
          f"saved_to_requeued_s={requeued['time'] - saved['time']:.2f} "
          f"requeued_to_first_step_s={first_new['time'] - requeued['time']:.2f} lost_steps={len(begun_after)}",
          flush=True)

if __name__ == "__main__":
    main()
