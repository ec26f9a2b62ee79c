"""PPO actor for tests that must see a signal or a kill arrive mid-run, whatever the machine's
speed: after a step it holds (every rank, polling a file) as RUN_DIR/test_hold says, so that the
run cannot finish first. Without RUN_DIR/test_hold it is the stock actor.

    test_hold = "stop"   hold after each job's first step until the job script wrote
                         RUN_DIR/stop_requested (Slurm's USR2: time limit or scancel)
    test_hold = "<N>"    hold after step N until killed
    test_hold = "term-after"  hold after the first step of each job's first start
                         (SLURM_RESTART_COUNT 0) until this rank got SIGTERM (a stage of a
                         pipeline preempted between steps, GRPO too: no critic needed)
    test_hold = "term"   hold in the first step of each job's first start (SLURM_RESTART_COUNT 0),
                         before the critic's values are read, until this rank got SIGTERM; the
                         step then goes on, its critic requests after the TERM (Slurm's
                         preemption must arrive mid-step, however fast the machine)
    RUN_DIR/test_slow_write (checkpointing.async_save): each background checkpoint write waits
                         until the job script wrote RUN_DIR/stop_requested, and SLOW_WRITE_S
                         more, so a stop arrives while the write is under way
Each hold has a ceiling (HOLD_CEILING_S), after which the actor fails, saying so.
"""

import argparse
import os
import threading
import time
from pathlib import Path

HOLD_CEILING_S = 600
SLOW_WRITE_S = 10


def after_step_with_hold(self, step, *, last, saved, save):
    hold = self.rd.root / "test_hold"
    mode = hold.read_text().strip() if hold.exists() else ""
    first = not self._first_step_done
    if not last and ((mode == "stop" and first) or mode == str(step)):
        if self.rank == 0:
            print(f"test: holding after step {step} ({mode})", flush=True)   # tests wait for this line
        deadline = time.monotonic() + HOLD_CEILING_S
        while not (mode == "stop" and self.rd.stop_requested.exists()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"test hold ({mode}) after step {step}: nothing came in {HOLD_CEILING_S} s")
            time.sleep(0.1)
    if (not last and first and mode == "term-after"
            and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"):
        if self.rank == 0:
            print(f"test: holding after step {step} until SIGTERM", flush=True)   # tests wait for this line
        if not _term.wait(HOLD_CEILING_S):
            raise RuntimeError(f"test hold (term-after) after step {step}: no SIGTERM came in {HOLD_CEILING_S} s")
    return _after_step(self, step, last=last, saved=saved, save=save)


def write_after_the_stop_request(self, request, args, finalize_args, tmp, final, step, on_commit):
    run_dir = Path(tmp).parents[2]   # RUN_DIR/checkpoints/actor/iter_<step>.tmp
    if (run_dir / "test_slow_write").exists():
        deadline = time.monotonic() + HOLD_CEILING_S
        while not (run_dir / "stop_requested").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(SLOW_WRITE_S)   # longer than a rank takes to exit: a stop that did not wait loses the write
        print(f"test: background write of step {step} goes on after the stop request", flush=True)
    return _write(self, request, args, finalize_args, tmp, final, step, on_commit)


_term = threading.Event()
_held = []


def on_term_noted(self):
    _term.set()
    _on_term(self)


def critic_results_with_hold(self, pending, step):
    hold = self.rd.root / "test_hold"
    if (not _held and hold.exists() and hold.read_text().strip() == "term"
            and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"):
        _held.append(step)
        if self.rank == 0:
            print(f"test: holding in step {step} until SIGTERM", flush=True)   # tests wait for this line
        if not _term.wait(HOLD_CEILING_S):
            raise RuntimeError(f"test hold (term) in step {step}: no SIGTERM came in {HOLD_CEILING_S} s")
    return _critic_results(self, pending, step)


# Imports under the guard: spawned helpers (megatron's checkpoint writer) re-run this file as
# __mp_main__ and would import torch and megatron again for nothing. The originals the wrappers
# above call are bound here, as module globals.
if __name__ == "__main__":
    from slurm_align.launchers import importing, leave

    with importing():   # as the product's launchers import
        from slurm_align.algorithms import ppo
        from slurm_align.models.checkpoint import AsyncCheckpointWriter
        from slurm_align.slurm.preemption import StopPoint

    _after_step, _on_term, _critic_results = StopPoint.after_step, StopPoint._on_term, ppo.PPOActor.critic_results
    StopPoint.after_step = after_step_with_hold
    StopPoint._on_term = on_term_noted
    ppo.PPOActor.critic_results = critic_results_with_hold
    _write = AsyncCheckpointWriter._write
    AsyncCheckpointWriter._write = write_after_the_stop_request
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    leave(ppo.main(Path(parser.parse_args().run_dir)))   # as the product's launchers end
