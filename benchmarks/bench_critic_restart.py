"""The critic under a stalled or loaded tritonserver: how long a request takes to come back
when its Python backend stub stalls past Triton's 1 s health deadline (the critic's watchdog
starts a new tritonserver, the client sends the request again), and whether plain CPU load
alone makes Triton declare the stub unhealthy.

Starts one real critic (launchers/critic.py, tiny value model, 1 rank) and then:
- stall: `--trials` times, stop the critic_infer stub (SIGSTOP) for `--stall-s`, send an infer
  while it is stopped, resume it; prints the time from the resume to the answer and whether the
  answer equals the one before the stall (and a later request's answer, too);
- load: `--hogs` busy Python processes for `--load-s` seconds while infer requests go one
  after another; prints how many were sent and how many failed.

    python benchmarks/bench_critic_restart.py [--trials 3] [--stall-s 2.5] [--hogs 40] [--load-s 90]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from slurm_align import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from tests.support.critic_support import CriticProcess, client_for, random_batch, write_run_dir


def stall_trials(proc: CriticProcess, client, trials: int, stall_s: float) -> None:
    rng = np.random.default_rng(0)
    for trial in range(trials):
        batch, other = random_batch(rng, 2, 8), random_batch(rng, 3, 8)
        reference, other_reference = client.infer(*batch)[0], client.infer(*other)[0]
        stubs = proc.triton_processes("triton_python_backend_stub", "critic_infer")
        for s in stubs:
            s.suspend()
        answer = client.infer_async(*batch)
        time.sleep(stall_s)
        for s in stubs:
            s.resume()
        resumed = time.monotonic()
        try:
            same = np.allclose(answer.result(timeout=300)[0], reference, atol=1e-5)
            took = time.monotonic() - resumed
            later = np.allclose(client.infer(*other)[0], other_reference, atol=1e-5)
            print(f"stall trial {trial}: answered {took:.1f} s after the resume, equal to the reference: "
                  f"{same}; a later request equal: {later}", flush=True)
        except Exception as e:   # the figure to report: what the client got
            print(f"stall trial {trial}: failed: {e}", flush=True)


def load_run(client, hogs: int, seconds: float) -> None:
    batch = random_batch(np.random.default_rng(1), 8, 48)
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(hogs)]
    sent = failed = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sent += 1
            try:
                client.infer(*batch)
            except Exception as e:
                failed += 1
                print(f"load: request {sent} failed: {e}", flush=True)
    finally:
        for p in procs:
            p.kill()
    print(f"load: {hogs} busy processes, {seconds:g} s: {sent} requests, {failed} failed", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--stall-s", type=float, default=2.5)
    ap.add_argument("--hogs", type=int, default=40, help="0 skips the load part")
    ap.add_argument("--load-s", type=float, default=90.0)
    args = ap.parse_args()
    run_dir = write_run_dir(Path(tempfile.mkdtemp(prefix="bench-critic-restart-")))
    proc = CriticProcess(run_dir)
    client = client_for(run_dir)
    try:
        proc.wait_ready()
        client.connect()
        stall_trials(proc, client, args.trials, args.stall_s)
        if args.hogs:
            load_run(client, args.hogs, args.load_s)
        proc.log.flush()
        restarts = Path(proc.log.name).read_text(errors="replace").count("starting it again")
        print(f"critic restarts logged: {restarts}")
    finally:
        client.close()
        proc.stop()


if __name__ == "__main__":
    main()
