"""PPO actor for tests that must see a signal or a kill arrive mid-run, whatever the machine's
speed: after a step it holds (every rank, polling a file) as RUN_DIR/test_hold says, so that the
run cannot finish first. Without RUN_DIR/test_hold it is the stock actor.

    test_hold = "stop"   hold after each job's first step until the job script wrote
                         RUN_DIR/stop_requested (Slurm's USR2: time limit or scancel)
    test_hold = "<N>"    hold after step N until killed
Each hold has a ceiling (HOLD_CEILING_S), after which the actor fails, saying so.
"""

import argparse
import sys
import time
from pathlib import Path

from slurm_align.algorithms import ppo
from slurm_align.algorithms.preemption import StopPoint

HOLD_CEILING_S = 600
_after_step = StopPoint.after_step


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
    return _after_step(self, step, last=last, saved=saved, save=save)


if __name__ == "__main__":
    StopPoint.after_step = after_step_with_hold
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    sys.exit(ppo.main(Path(parser.parse_args().run_dir)))
