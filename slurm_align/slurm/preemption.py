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
- on the actor's ranks a TERM is a stop request like the warning, with a deadline: the profile's
  `preempt_grace_s` (the partition's GraceTime, exported as SLURM_ALIGN_PREEMPT_GRACE_S). When
  the step in flight can end and be saved within it (StopPoint._on_term), the ranks finish it and
  stop at that step boundary as for USR2 (nothing is redone); otherwise, or when the step has not
  ended by the deadline, rank 0 stops the run at once at its newest complete checkpoint and the
  step in flight is redone after the restart. Either way rank 0 writes stopped_step and
  `stopped_by` = TERM, every rank exits 0, and the script requeues the job (with requeue true)
  as for the warning: a job that ends within GraceTime is not requeued by Slurm itself
  (measured: FAILED, Restarts=0);
- the critic's own ranks serve on after a TERM until the actor has stopped (stopped_step), then
  exit 0. Its tritonserver inherits the block; the Python backend stubs tritonserver starts
  unblock every signal but handle TERM themselves (they live on), and PyTriton's tensor store,
  a multiprocessing process each stub spawns, would die of it (measured: every request after the
  TERM then fails with BrokenPipeError): under Slurm with a preemption grace the critic runs
  PyTriton without it (PYTRITON_NO_TENSORSTORE: tensors travel base64-encoded over the stub's
  socket);
- where the job is being torn down anyway (logs/first_failure or logs/cancelled exists: the script
  or `slurm-align cancel` sent the TERM), any rank exits at once.

Times of the stages go to RUN_DIR/preemption.jsonl (the script adds stop_requested and
requeued), for post-mortems and benchmarks/bench_preempt.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from slurm_align.models.checkpoint_names import find_latest
from slurm_align.parallel import quiet
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

GRACE_ENV = "SLURM_ALIGN_PREEMPT_GRACE_S"
"""The profile's preempt_grace_s, exported by the job script (Slurm profiles)."""

EXIT_MARGIN_S = 5.0
"""Of the grace, what the actor keeps for writing stopped_step, exiting and the script's requeue."""

CRITIC_EXTRA_S = 30.0
"""The critic waits for the actor's stop up to the grace plus this (Slurm's KILL comes first)."""


def preempt_grace_s() -> float:
    """Seconds from Slurm's TERM to its KILL that this job may use (0 outside Slurm profiles)."""
    return float(os.environ.get(GRACE_ENV, "0") or 0)


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


def critic_survives_term(rd: RunDir, limit_s: float | None = None, poll_s: float = 0.2) -> list[Callable[[], None]]:
    """For the critic (every rank): a TERM from Slurm's preemption is not the end yet. Serve on
    (requests in flight and new ones: the actor may be finishing its step and saving) and exit
    once the actor has stopped (stopped_step), or at once when the job is being torn down, or
    after `limit_s` (default: the preemption grace plus CRITIC_EXTRA_S) without either. Only where
    `block_term` blocked TERM (under Slurm); call before PyTriton starts.

    Returns a list the caller appends clean-ups to (the server's stop): they run before the exit.
    They must: tritonserver, started with TERM blocked, would outlive the critic and keep its
    port (measured: the requeued start's critic then could not bind it)."""
    cleanups: list[Callable[[], None]] = []
    if not term_blocked():
        return cleanups
    if preempt_grace_s() > EXIT_MARGIN_S:
        # the actor may finish its step after the TERM, and PyTriton's tensor store process would
        # die of it (module docstring); without a grace the shared-memory path stays (faster:
        # base64 there and back took 0.4 s for an 8 MiB request, measured on the test machine)
        os.environ["PYTRITON_NO_TENSORSTORE"] = "1"
    limit_s = preempt_grace_s() + CRITIC_EXTRA_S if limit_s is None else limit_s
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
            print(f"critic: SIGTERM received (preemption?): serving on until the actor has stopped "
                  f"(at most {limit_s:.0f} s)", flush=True)
            threading.Thread(target=wait_for_actor, name="term-wait", daemon=True).start()

    on_term(on_signal)
    return cleanups


def ignore_stop_signal() -> None:
    """For components the actor drives (the critic): USR2 is ignored; the actor asks them to save
    and shuts them down. Ignored, not handled: child processes started after this (PyTriton's
    tritonserver and its Python backends) inherit the ignore, where a handler would be reset to
    the default action, which kills them, when `scancel --signal=USR2` reaches every process."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def enter_role(component: str, rd: RunDir) -> list[Callable[[], None]]:
    """Take the preemption role the component's kind declares (config/components.py), on every
    rank, after `block_term` and before servers or engines start: `survives` (a server: serve on
    after a TERM until the leader stopped, `critic_survives_term`) and `follows` (USR2 ignored,
    the leader drives the stop); `leads` installs nothing here (the leader's loop runs StopPoint).
    Returns the list of clean-ups to run before a surviving rank exits (see critic_survives_term)."""
    from slurm_align.config.components import component_kind

    role = component_kind(component).preemption
    if role == "leads":
        return []
    ignore_stop_signal()
    return critic_survives_term(rd) if role == "survives" else []


class StopPoint:
    """Install in the actor before the run starts; call `after_step` after every step."""

    def __init__(self, comm, rd: RunDir, grace_s: float | None = None, checkpoints: Path | None = None):
        self.comm, self.rd = comm, rd
        # where a TERM's give-up finds the newest checkpoint: the actor's, or a trainer's (sft, rm, ...)
        self.checkpoints = rd.checkpoints("actor") if checkpoints is None else checkpoints
        self.rank = comm.Get_rank()
        self.grace_s = preempt_grace_s() if grace_s is None else grace_s
        self._signalled = False
        self._terminated = False
        self._first_step_done = False
        self._lock = threading.Lock()    # the TERM thread and the loop: one of them stops the run
        self._stopping = False           # the loop reached its stop point or its last step
        self._last_done = 0              # the newest step whose after_step ran
        self._step_started = time.monotonic()
        self._last_step_s: float | None = None   # the previous step of this job, its save included
        signal.signal(signal.SIGUSR2, self._on_signal)
        on_term(self._on_term)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True   # only a flag: the decision is taken at the step boundary

    def _on_term(self) -> None:
        """Slurm's SIGTERM (preemption, cancel), on this rank's TERM thread.

        Slurm KILLs the job `grace_s` after the TERM. When the step in flight fits (the previous
        step's time, its save included, left from when this one started, ends before the grace
        minus EXIT_MARGIN_S), the TERM only flags the stop: the ranks agree on it at this step's
        boundary (`agreed` answers 2), the step is saved, nothing is redone. Otherwise rank 0
        stops the run at once at the newest complete checkpoint (`_abandon`), and a watchdog
        does the same if the step has not ended by the deadline. What checkpoint N holds is
        whole (its rollouts flushed before the commit, its metrics and spans written before the
        save), and a resume cuts the stores back to N: the step in flight is then lost and redone.
        Ranks other than 0 follow rank 0's decision (`_follow`)."""
        if job_ending(self.rd):   # the script or a cancel is ending the job: no save
            os._exit(TERM_EXIT_CODE)
        now = time.monotonic()
        with self._lock:
            if self._terminated:
                return
            self._terminated = True
            in_flight = self._last_done + 1
        deadline = now + self.grace_s - EXIT_MARGIN_S
        if self.rank != 0:
            threading.Thread(target=self._follow, name="term-follow", daemon=True).start()
            return
        expected_end = None if self._last_step_s is None else self._step_started + self._last_step_s
        fits = self.grace_s > EXIT_MARGIN_S and (expected_end is None or expected_end <= deadline)
        record_event(self.rd, "term_received", in_flight=in_flight, grace_s=self.grace_s,
                     finish=fits, expected_s=None if expected_end is None else round(expected_end - now, 3))
        if not fits:
            self._abandon(f"the step in flight ({in_flight}) cannot end within preempt_grace_s={self.grace_s:g}")
            return
        print(f"SIGTERM received (Slurm preempts or ends the job): finishing step {in_flight}, then saving "
              f"(preempt_grace_s={self.grace_s:g})", flush=True)

        def watchdog() -> None:
            time.sleep(max(0.0, deadline - time.monotonic()))
            self._abandon(f"step {in_flight} did not end within preempt_grace_s={self.grace_s:g}")
        threading.Thread(target=watchdog, name="term-watchdog", daemon=True).start()

    def _abandon(self, why: str) -> None:
        """Rank 0: stop now at the newest complete checkpoint, unless the loop already reached its
        stop point (then it saves and stops by itself). The lock is held to the exit: the loop
        cannot reach its stop point meanwhile."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            latest = find_latest(self.checkpoints)
            step = int(latest.name.split("_")[-1]) if latest is not None else 0
            write_atomic(self.rd.stopped_by, "TERM\n")
            write_atomic(self.rd.stopped_step, f"{step}\n")   # last: the script and the critic read it
            record_event(self.rd, "saved", step=step, by="TERM", abandoned=True)
            print(f"SIGTERM received: {why}: stopped at the checkpoint of step {step}; the steps after it "
                  "are redone after the restart", flush=True)
            os._exit(0)   # the other ranks follow (srun kills none that exit 0)

    def _follow(self, poll_s: float = 0.1) -> None:
        """Ranks > 0 after a TERM: when rank 0 gave up the step in flight (stopped_step written
        while this rank is not at the stop point), exit 0 too; their collectives would hang."""
        while True:
            with self._lock:
                if self._stopping:
                    return
                if self.rd.stopped_step.exists():
                    self._stopping = True
                    print(f"rank {self.rank}: the run stopped at Slurm's SIGTERM; exiting", flush=True)
                    os._exit(0)
            time.sleep(poll_s)

    def exit_if_stopped_by_term(self) -> None:
        """Call where a rank failed. After a TERM, rank 0 gives the step in flight up and stops at
        the newest checkpoint (`_abandon`: the step is redone after the restart) rather than fail
        the job. On the other ranks: when rank 0 has stopped the run at Slurm's TERM (its exit
        broke this rank's collective), exit 0 as it did. Any other failure is left to the caller."""
        if self._terminated and self.rank == 0:
            self._abandon("the step in flight failed after it")   # exits, unless already at the stop point
        if (self.rd.stopped_step.exists() and self.rd.stopped_by.exists()
                and self.rd.stopped_by.read_text().strip() == "TERM"):
            print(f"rank {self.rank}: the run stopped at Slurm's SIGTERM; exiting", flush=True)
            os._exit(0)

    def step_begins(self) -> None:
        """Call as each step starts: a TERM's estimate times the steps from here (not the set-up
        before the first one)."""
        self._step_started = time.monotonic()

    def resumed(self, start_step: int, checkpoint: Path | None) -> None:
        """Where this start goes on from (rank 0 says it when resumed: the log line users look for)."""
        with self._lock:
            self._last_done = start_step - 1
        self._step_started = time.monotonic()
        if self.rank == 0 and checkpoint is not None:
            print(f"resuming from step {start_step} (checkpoint {checkpoint})", flush=True)
            record_event(self.rd, "resumed", step=start_step)

    def agreed(self) -> int:
        """Collective over the actor's ranks, the same on all of them: 0 no stop, 1 the script's
        warning (USR2, stop_requested), 2 Slurm's SIGTERM on some rank."""
        from mpi4py import MPI  # deferred: importing mpi4py initialises MPI

        local = 2 if self._terminated else int(self._signalled or self.rd.stop_requested.exists())
        quiet.barrier(self.comm)
        return int(self.comm.allreduce(local, op=MPI.MAX))

    def after_step(self, step: int, *, last: bool, saved: bool, save: Callable[[int], None]) -> bool:
        """True when the run must stop now (after `step`, which is then saved)."""
        if not self._first_step_done:
            self._first_step_done = True
            if self.rank == 0:
                record_event(self.rd, "first_step", step=step)
        now = time.monotonic()
        self._last_step_s, self._step_started = now - self._step_started, now
        with self._lock:
            self._last_done = step
            self._stopping = self._stopping or last   # the run ends by itself: no give-up after this
        if last:
            return False
        why = self.agreed()
        if not why:
            return False
        with self._lock:   # from here on a TERM's give-up (`_abandon`, `_follow`) leaves the stop to us
            self._stopping = True
        if not saved:
            save(step)
        if self.rank == 0:
            write_atomic(self.rd.stopped_by, "TERM\n" if why == 2 else "warning\n")
            write_atomic(self.rd.stopped_step, f"{step}\n")   # last: the script and the critic read it
            record_event(self.rd, "saved", step=step, by="TERM" if why == 2 else "warning")
            print(f"stopped for preemption at step {step}: saved", flush=True)
        return True
