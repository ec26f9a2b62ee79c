"""Stop for preemption or the time limit at a step boundary, every actor rank agreeing.

The batch script turns Slurm's warning (`--signal=B:USR2@grace`, or TERM) into the file
RUN_DIR/stop_requested. It does not pass the signal on: Slurm delivers a step's signals to whole
process groups, and helper processes that keep USR2's default action die of it (measured:
megatron's checkpoint writer process mid-save, PyTriton's tritonserver). The ranks act only at a
step boundary anyway, where the file is as quick. (A USR2 sent to every task, as
`scancel --signal=USR2 JOB` does, still counts: the actor's ranks note it and the critic ignores
it, but a checkpoint writer may die of it; signal the batch script: `scancel --batch`.)
After each step the actor ranks run one allreduce of "this rank saw a request": all of them stop
after the same step, none decides alone. The loop saves that step (unless it was just saved), rank 0
records it in RUN_DIR/stopped_step, and the ranks exit 0 (srun --kill-on-bad-exit would kill the
slower ranks at a non-zero exit). The script reads stopped_step as "requeue, or end as stopped
for preemption at step N", and records STOPPED_EXIT_CODE for every component.

Times of the stages go to RUN_DIR/preemption.jsonl (the script adds stop_requested and
requeued), for post-mortems and benchmarks/bench_preempt.py.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

from slurm_align.rundir import RunDir, write_atomic

STOPPED_EXIT_CODE = 75
"""Exit code the job script records for the components of a job that stopped at a checkpoint,
and its own exit code when it does not requeue (EX_TEMPFAIL: try again later)."""


def record_event(rd: RunDir, event: str, **fields: Any) -> None:
    """Append one event line (one write call: lines from several writers do not interleave)."""
    line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
    with open(rd.preemption_events, "a") as f:
        f.write(line)


def read_events(rd: RunDir) -> list[dict]:
    try:
        text = rd.preemption_events.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ignore_stop_signal() -> None:
    """For components the actor drives (the critic): USR2 is ignored; the actor asks them to save
    and shuts them down. Ignored, not handled: child processes started after this (PyTriton's
    tritonserver and its Python backends) inherit the ignore, where a handler would be reset to
    the default action, which kills them, when `scancel --signal=USR2` reaches every process."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class StopPoint:
    """Install in the actor before the run starts; call `after_step` after every step."""

    def __init__(self, comm, rd: RunDir):
        self.comm, self.rd = comm, rd
        self.rank = comm.Get_rank()
        self._signalled = False
        self._first_step_done = False
        signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True   # only a flag: the decision is taken at the step boundary

    def resumed(self, start_step: int, checkpoint: Path | None) -> None:
        """Rank 0 says where a resumed run goes on from (the log line users look for)."""
        if self.rank == 0 and checkpoint is not None:
            print(f"resuming from step {start_step} (checkpoint {checkpoint})", flush=True)
            record_event(self.rd, "resumed", step=start_step)

    def agreed(self) -> bool:
        """Collective over the actor's ranks: True on all of them when any saw a request."""
        from mpi4py import MPI  # deferred: importing mpi4py initialises MPI

        local = self._signalled or self.rd.stop_requested.exists()
        return bool(self.comm.allreduce(int(local), op=MPI.MAX))

    def after_step(self, step: int, *, last: bool, saved: bool, save: Callable[[int], None]) -> bool:
        """True when the run must stop now (after `step`, which is then saved)."""
        if not self._first_step_done:
            self._first_step_done = True
            if self.rank == 0:
                record_event(self.rd, "first_step", step=step)
        if last or not self.agreed():
            return False
        if not saved:
            save(step)
        if self.rank == 0:
            write_atomic(self.rd.stopped_step, f"{step}\n")
            record_event(self.rd, "saved", step=step)
            print(f"stopped for preemption at step {step}: actor and critic saved", flush=True)
        return True
