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

Slurm's own preemption (PreemptMode=REQUEUE or CANCEL, with the partition's GraceTime) is
different: it sends SIGTERM to every task of every step at once, and to the batch shell only when
GraceTime is over, together with the kill (shared/STACK.md, turn 3), so the script's trap is too
late. The ranks catch it themselves: under Slurm the launchers block SIGTERM before anything else
starts (`block_term`), so every thread and child process (megatron's checkpoint writer,
tritonserver and its Python backends) inherits the block and lives on, and one thread per rank
waits for the signal (`sigwait`):
- on the actor's ranks a TERM stops the run at once at its newest complete checkpoint (the step in
  flight cannot finish: the critic's Triton model backends die of the same TERM, see
  StopPoint._on_term); rank 0 writes stopped_step and `stopped_by` = TERM, every rank exits 0, and
  the script requeues the job (with requeue true) as for the warning: a job that ends within
  GraceTime is not requeued by Slurm itself (measured: FAILED, Restarts=0). With save_interval 1
  at most one step is redone;
- the critic's own ranks live on after a TERM until the actor has stopped (stopped_step), then
  exit 0;
- where the job is being torn down anyway (logs/first_failure or logs/cancelled exists: the script
  or `slurm-align cancel` sent the TERM), any rank exits at once.
A TERM therefore needs only seconds of GraceTime; a larger save_interval loses more steps.

Times of the stages go to RUN_DIR/preemption.jsonl (the script adds stop_requested and
requeued), for post-mortems and benchmarks/bench_preempt.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
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


TERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a rank that a TERM ended at once (the job was failing or cancelled)."""


def block_term() -> bool:
    """Call first thing in a launcher, before MPI, torch or any thread or child process starts.
    Inside a Slurm step, SIGTERM is blocked in this thread and so in every thread and process
    started after (a blocked mask survives fork and exec, a handler does not); `on_term` then
    waits for it in a thread of its own. Elsewhere (the local profile) nothing changes: a TERM
    there is a cancel. True when blocked."""
    if "SLURM_JOB_ID" not in os.environ:
        return False
    # multiprocessing's resource tracker UNBLOCKS SIGINT and SIGTERM in the calling thread after
    # it has started its process (CPython bpo-33613), which megatron's checkpoint writer does at
    # the first save (measured: the actor's main thread then died of Slurm's TERM). Start it now,
    # then block: later calls find it running and leave the mask alone.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    return True


def term_blocked() -> bool:
    return signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def job_ending(rd: RunDir) -> bool:
    """The job is being torn down (a component failed, or `slurm-align cancel`): a TERM then
    means 'go now', not 'save first'."""
    return rd.first_failure.exists() or (rd.logs / "cancelled").exists()


def on_term(callback: Callable[[], None]) -> None:
    """Run `callback` (in a thread of its own) at every SIGTERM when `block_term` blocked it;
    else as a signal handler."""
    if term_blocked():
        def wait() -> None:
            while True:
                signal.sigwait({signal.SIGTERM})
                callback()
        threading.Thread(target=wait, name="sigterm", daemon=True).start()
    else:
        signal.signal(signal.SIGTERM, lambda signum, frame: callback())


def critic_survives_term(rd: RunDir, limit_s: float = 900.0, poll_s: float = 0.2) -> list[Callable[[], None]]:
    """For the critic (every rank): a TERM from Slurm's preemption is not the end yet. Exit once
    the actor has stopped (stopped_step), or at once when the job is being torn down, or after
    `limit_s` without either. Only where `block_term` blocked TERM (under Slurm).

    Returns a list the caller appends clean-ups to (the server's stop): they run before the exit.
    They must: tritonserver, started with TERM blocked, would outlive the critic and keep its
    port (measured: the requeued start's critic then could not bind it)."""
    cleanups: list[Callable[[], None]] = []
    if not term_blocked():
        return cleanups
    started = threading.Event()

    def leave(code: int) -> None:
        for fn in reversed(cleanups):
            try:
                fn()
            except Exception as exc:   # exiting anyway: say why the clean-up failed
                print(f"critic: clean-up at SIGTERM failed: {exc!r}", flush=True)
        os._exit(code)

    def wait_for_actor() -> None:
        t0 = time.monotonic()
        while not (rd.stopped_step.exists() or job_ending(rd)) and time.monotonic() - t0 < limit_s:
            time.sleep(poll_s)
        saved = rd.stopped_step.exists()
        print(f"critic: SIGTERM received; {'the actor stopped' if saved else 'the job is ending'}: exiting",
              flush=True)
        leave(0 if saved else TERM_EXIT_CODE)

    def on_signal() -> None:
        if not started.is_set():
            started.set()
            print("critic: SIGTERM received (preemption?): serving on until the actor has stopped", flush=True)
            threading.Thread(target=wait_for_actor, name="term-wait", daemon=True).start()

    on_term(on_signal)
    return cleanups


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
        self._terminated = False
        self._first_step_done = False
        signal.signal(signal.SIGUSR2, self._on_signal)
        on_term(self._on_term)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True   # only a flag: the decision is taken at the step boundary

    def _on_term(self) -> None:
        """Slurm's SIGTERM (preemption, cancel): stop at once at the newest complete checkpoint.

        The step in flight cannot be finished: the critic's PyTriton model backends
        (triton_python_backend_stub, started by tritonserver with every signal unblocked) die of
        the same TERM, so every critic request fails from now on (measured on the test cluster).
        What the newest checkpoint N holds is whole (its rollouts flushed before the commit, its
        metrics and spans written before the save), and a resume cuts the stores back to N, so
        the step in flight is simply lost and redone: with save_interval 1, at most one step."""
        if job_ending(self.rd):   # the script or a cancel is ending the job: no save
            os._exit(TERM_EXIT_CODE)
        if self._terminated:
            return
        self._terminated = True
        if self.rank == 0:
            # deferred: checkpoint imports torch, and this module is imported before block_term
            from slurm_align.models.checkpoint import find_latest

            record_event(self.rd, "term_received")
            latest = find_latest(self.rd.checkpoints("actor"))
            step = int(latest.name.split("_")[-1]) if latest is not None else 0
            write_atomic(self.rd.stopped_by, "TERM\n")
            write_atomic(self.rd.stopped_step, f"{step}\n")   # last: the script and the critic read it
            record_event(self.rd, "saved", step=step, by="TERM")
            print(f"SIGTERM received (Slurm preempts or ends the job): stopped at the checkpoint of step "
                  f"{step}; the step in flight is redone after the restart", flush=True)
        os._exit(0)   # every rank, at once: the others got the same TERM (srun kills none that exit 0)

    def exit_if_stopped_by_term(self) -> None:
        """Call where a rank failed: when rank 0 has already stopped the run at Slurm's TERM (its
        exit broke this rank's collective before this rank's own TERM was handled), exit 0 as
        the others did instead of failing the job."""
        if self._terminated or (self.rd.stopped_step.exists() and self.rd.stopped_by.exists()
                                and self.rd.stopped_by.read_text().strip() == "TERM"):
            print(f"rank {self.rank}: the run stopped at Slurm's SIGTERM; exiting", flush=True)
            os._exit(0)

    def resumed(self, start_step: int, checkpoint: Path | None) -> None:
        """Rank 0 says where a resumed run goes on from (the log line users look for)."""
        if self.rank == 0 and checkpoint is not None:
            print(f"resuming from step {start_step} (checkpoint {checkpoint})", flush=True)
            record_event(self.rd, "resumed", step=start_step)

    def agreed(self) -> int:
        """Collective over the actor's ranks, the same on all of them: 0 no stop, 1 the script's
        warning (USR2, stop_requested), 2 Slurm's SIGTERM on some rank."""
        from mpi4py import MPI  # deferred: importing mpi4py initialises MPI

        local = 2 if self._terminated else int(self._signalled or self.rd.stop_requested.exists())
        return int(self.comm.allreduce(local, op=MPI.MAX))

    def after_step(self, step: int, *, last: bool, saved: bool, save: Callable[[int], None]) -> bool:
        """True when the run must stop now (after `step`, which is then saved)."""
        if not self._first_step_done:
            self._first_step_done = True
            if self.rank == 0:
                record_event(self.rd, "first_step", step=step)
        if last:
            return False
        why = self.agreed()
        if not why:
            return False
        if not saved:
            save(step)
        if self.rank == 0:
            write_atomic(self.rd.stopped_by, "TERM\n" if why == 2 else "warning\n")
            write_atomic(self.rd.stopped_step, f"{step}\n")   # last: the script and the critic read it
            record_event(self.rd, "saved", step=step, by="TERM" if why == 2 else "warning")
            print(f"stopped for preemption at step {step}: actor and critic saved", flush=True)
        return True
