"""Launch a run: validate, render, write the run directory, then submit (Slurm) or start (local).

    job = launch_run(run, profile, run_dir)   # returns at once
    job.wait()                                # "COMPLETED" / "FAILED" / "CANCELLED"

Everything that can be wrong with the input is found before anything is written or submitted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import yaml
from rich.console import Console
from rich.live import Live
from rich.table import Table

from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import check_against_profile, check_run_dir, check_runnable, with_profile_defaults
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.rundir import RunDir, create_run_secret, write_atomic
from slurm_align.slurm import state as job_state
from slurm_align.slurm.capacity import check_fits_cluster, nodes_needed
from slurm_align.slurm.choose import check_shared_paths
from slurm_align.slurm.executor import HetjobExecutor
from slurm_align.slurm.preemption import STOPPED_EXIT_CODE
from slurm_align.slurm.render import CONTAINER_SETUP, Entry, container_setup_text, job_python, render_script

SETTLE_S = 60.0
"""How long Job.wait() waits, once the job's state is final, for components Slurm is still ending."""


@dataclass
class JobRecord:
    """What was submitted, saved as RUN_DIR/job.json so `status`/`cancel` work later."""

    backend: str                 # "slurm" or "local"
    job_id: str
    run_dir: str
    components: list[str]
    profile: str
    submitted_at: str = field(default_factory=lambda: dt.datetime.now().isoformat(timespec="seconds"))
    pid: int | None = None       # local backend: the script's process (its own session)
    after: list[str] = field(default_factory=list)
    """Slurm jobs this one starts after (afterok): `submit --after`, a pipeline's earlier stages."""

    def save(self) -> None:
        write_atomic(RunDir(Path(self.run_dir)).job_record, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: Path) -> JobRecord:
        path = RunDir(run_dir).job_record
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise ConfigError([f"no job was launched from this run directory ({path.name} missing)"],
                              run_dir) from None


class Job:
    """A launched run, Slurm or local; the same calls for both."""

    def __init__(self, record: JobRecord, popen: subprocess.Popen | None = None):
        self.record = record
        self._popen = popen
        self.run_dir = RunDir(Path(record.run_dir))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def _exit_codes(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for comp in self.record.components:
            path = self.run_dir.logs / comp / "exit_code"
            try:
                codes[comp] = int(path.read_text().strip())
            except (FileNotFoundError, ValueError):
                codes[comp] = None
        return codes

    def _local_alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        try:
            return psutil.Process(self.record.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def component_states(self) -> dict[str, str]:
        """State of each component: from its exit code once it ended, else the scheduler's view."""
        codes = self._exit_codes()
        if self.record.backend in ("local", "here"):   # a process of ours, not a job of Slurm's
            alive = self._local_alive()
            cancelled = (self.run_dir.logs / "cancelled").exists()
            out = {}
            for comp, code in codes.items():
                if code is not None:
                    out[comp] = {0: job_state.COMPLETED, STOPPED_EXIT_CODE: job_state.STOPPED}.get(
                        code, job_state.FAILED)
                elif alive:
                    out[comp] = job_state.RUNNING
                else:
                    out[comp] = job_state.CANCELLED if cancelled else job_state.FAILED
            if cancelled and not alive:
                out = {c: (job_state.CANCELLED if s != job_state.COMPLETED else s) for c, s in out.items()}
            return out
        _, raw = job_state.slurm_state(self.job_id)
        first = self.run_dir.first_failed_component()
        cancelled = bool(raw) and all(job_state.fold(r) == job_state.CANCELLED for r in raw)
        out = {}
        for i, comp in enumerate(self.record.components):
            raw_i = raw[i] if i < len(raw) else (raw[0] if raw else "")
            sched = job_state.fold(raw_i)
            code = codes.get(comp)
            if (comp == first and code not in (None, 0, STOPPED_EXIT_CODE) and not cancelled
                    and not job_state.is_completing(raw_i)):
                # The component the job script saw fail first. Its stop of the others can leave
                # Slurm's record of this one CANCELLED (CI: the critic exited 3, its component
                # CANCELLED, the actor's FAILED); only a job cancelled as a whole is a cancel.
                out[comp] = job_state.FAILED
            elif code == STOPPED_EXIT_CODE:
                # stopped at a checkpoint: requeued (Slurm says pending/running) or ended as stopped
                out[comp] = job_state.STOPPED if sched in job_state.FINAL_STATES else sched
            elif code is None or code == 0 or sched == job_state.CANCELLED:
                out[comp] = sched
            elif job_state.is_completing(raw_i):
                # A cancel's SIGTERM ends the ranks with non-zero codes, which the job script may
                # write before its own TERM trap runs: once Slurm is ending the job, its final
                # state (CANCELLED, FAILED) says why, not the codes.
                out[comp] = job_state.RUNNING
            else:
                out[comp] = job_state.FAILED  # known before Slurm finishes tearing the job down
        return out

    def state(self) -> str:
        return job_state.combine(list(self.component_states().values()))

    def failed_logs(self) -> dict[str, list[Path]]:
        """Log files of the components that failed."""
        states = self.component_states()
        return {c: sorted((self.run_dir.logs / c).glob("rank*.log"))
                for c, s in states.items() if s == job_state.FAILED}

    def wait(self, poll_s: float = 1.0, timeout_s: float | None = None, console: Console | None = None) -> str:
        """Block until the job ends; with a console, show each component's state live."""
        start = time.monotonic()
        live = Live(self._table(), console=console, refresh_per_second=2) if console else None
        if live:
            live.start()
        settle_by = None
        try:
            while True:
                comps = self.component_states()
                overall = job_state.combine(list(comps.values()))
                if live:
                    live.update(self._table(comps))
                if overall == job_state.FAILED and self._restarted():
                    settle_by = None
                    continue
                if overall in job_state.FINAL_STATES:
                    # A failed job's other components may still be ending (Slurm: COMPLETING):
                    # wait for them (at most SETTLE_S), so that what is read after wait()
                    # (failed_logs, status) is final too.
                    settle_by = settle_by or time.monotonic() + SETTLE_S
                    if job_state.RUNNING in comps.values() and time.monotonic() < settle_by:
                        time.sleep(poll_s)
                        continue
                    if self._popen is not None:
                        self._popen.wait()
                    return overall
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise TimeoutError(f"job {self.job_id} still {overall} after {timeout_s:.0f} s")
                time.sleep(poll_s)
        finally:
            if live:
                live.stop()

    def _restarted(self) -> bool:
        """Whether this failed Slurm job was resubmitted (fault_tolerance.max_restarts): then this
        handle follows the new job. The job script decides after its components ended, so the
        job's own end (Slurm's state) is waited for first, at most SETTLE_S."""
        if self.record.backend != "slurm" or not self.run_dir.config.is_file():
            return False
        run = yaml.safe_load(self.run_dir.config.read_text()) or {}
        if not (run.get("fault_tolerance") or {}).get("max_restarts"):
            return False
        deadline = time.monotonic() + SETTLE_S
        while job_state.slurm_state(self.job_id)[0] not in job_state.FINAL_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
        now = JobRecord.load(self.run_dir.root)
        if now.job_id == self.job_id:
            return False
        self.record = now
        return True

    def _table(self, comps: dict[str, str] | None = None) -> Table:
        table = Table(title=f"job {self.job_id} ({self.record.backend}) {self.run_dir.root}")
        table.add_column("component")
        table.add_column("state")
        table.add_column("logs")
        for comp, st in (comps or {c: "…" for c in self.record.components}).items():
            table.add_row(comp, st, str(self.run_dir.logs / comp))
        return table

    def stop(self) -> None:
        """Ask the job to stop at a checkpoint, as Slurm's warning before preemption does (USR2 to
        the job script: every role saves, then the script ends as STOPPED). Local and --here jobs."""
        assert self.record.pid is not None, "a local or --here job records its script's pid"
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.record.pid, signal.SIGUSR2)

    def cancel(self) -> None:
        if self.record.backend in ("local", "here"):
            write_atomic(self.run_dir.logs / "cancelled", "cancelled\n")
            assert self.record.pid is not None, "a local job records its script's pid"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.record.pid, signal.SIGTERM)
            return
        subprocess.run(["scancel", self.job_id], check=True, capture_output=True, text=True)


def _check_not_running(rd: RunDir) -> None:
    if rd.job_record.exists():
        old = Job(JobRecord.load(rd.root))
        if old.state() in (job_state.PENDING, job_state.RUNNING):
            raise ConfigError([f"job {old.job_id} from this run directory is still active; "
                               "choose another --run-dir or cancel it first"], rd.root)


def produced_later(path: Path, after: Sequence[str], produced: Sequence[Path] = ()) -> bool:
    """Whether a missing input will be written by a job this one starts after: it lies inside one
    of `produced` (a pipeline's earlier stages' run directories), or inside a run directory whose
    job.json names one of the `after` job ids (`submit --after JOBID`)."""
    path = Path(path).absolute()
    if any(path.is_relative_to(Path(p).absolute()) for p in produced):
        return True
    for folder in path.parents:
        record = RunDir(folder).job_record
        if record.is_file():
            with contextlib.suppress(ValueError, OSError):
                return str(json.loads(record.read_text()).get("job_id")) in after
            return False
    return False


def resolve_input_paths(run: RunConfig, after: Sequence[str] = (), produced: Sequence[Path] = ()) -> RunConfig:
    """Data, tokenizer and initial checkpoints as absolute paths (relative ones are taken from
    the directory `slurm-align` runs in), each checked to exist before anything is submitted,
    unless a job this one starts after writes it (`produced_later`): a pipeline's PPO stage reads
    the SFT stage's checkpoint folder, which exists only once that stage has run."""
    problems, updates = [], {}
    if run.data.train_path is None and not run.data.mixture:
        problems.append(f"field 'data.train_path': required for algorithm '{run.algorithm}' "
                        "(a JSONL file: prompts for ppo, SFT pairs for sft, preferences for rm/dpo)")
    fields = {"data": ("train_path", "val_path"), "model": ("init_checkpoint", "hf_path"),
              "critic_model": ("init_checkpoint", "hf_path"), "eval": ("val_path",)}
    for section, names in fields.items():
        sub = getattr(run, section)
        if sub is None:
            continue
        changed: dict[str, object] = {}
        for name in names:
            value = getattr(sub, name)
            if value is None:
                continue
            path = Path(value).expanduser().resolve()
            if not path.exists() and not produced_later(path, after, produced):
                problems.append(f"field '{section}.{name}': got {str(value)!r}; no such file or directory "
                                f"(relative paths are taken from {Path.cwd()})")
            changed[name] = path
        if section in ("model", "critic_model") and sub.tokenizer.path is not None:
            tok = Path(sub.tokenizer.path).expanduser().resolve()
            if not tok.is_file():
                problems.append(f"field '{section}.tokenizer.path': got {str(sub.tokenizer.path)!r}; no such file")
            changed["tokenizer"] = sub.tokenizer.model_copy(update={"path": tok})
        if section == "data" and sub.mixture:   # each mixed source, as train_path
            mixture = []
            for i, src in enumerate(sub.mixture):
                path = Path(src.path).expanduser().resolve()
                if not path.exists():
                    problems.append(f"field 'data.mixture[{i}].path': got {str(src.path)!r}; no such file or "
                                    f"directory (relative paths are taken from {Path.cwd()})")
                mixture.append(src.model_copy(update={"path": path}))
            changed["mixture"] = mixture
        if changed:
            updates[section] = sub.model_copy(update=changed)
    if problems:
        raise ConfigError(problems)
    return run.model_copy(update=updates)


def prepare_launch(run: RunConfig, profile: ClusterProfile, run_dir: Path, *, entry: Entry = Entry(),
                   after: Sequence[str] = (), produced: Sequence[Path] = ()) -> tuple[RunConfig, RunDir, str]:
    """Every check launch_run makes before it writes or submits anything: (the run with its paths
    resolved, its run directory, the rendered script). A pipeline checks all its stages this way
    before it queues the first."""
    check_against_profile(run, profile)
    run = with_profile_defaults(run, profile)   # e.g. the GPU profile's bf16
    check_run_dir(Path(run_dir))
    rd = RunDir(Path(run_dir).resolve())
    run = resolve_input_paths(run, after, produced).model_copy(update={"run_dir": rd.root})
    check_runnable(run, profile)
    script = render_script(run, profile, rd.root, entry)   # raises ConfigError on bad values
    check_shared_paths(profile, rd.root, job_python(profile))
    check_fits_cluster(profile, run.components)            # after render: values are checked then
    if after and profile.kind == "local":
        raise ConfigError.at("--after", ":".join(after), f"profile {profile.name!r} is local (no Slurm): "
                             "dependencies need a Slurm profile")
    _check_not_running(rd)
    return run, rd, script


HERE_ENV = "SLURM_JOB_ID"
"""Set in every shell of an allocation (salloc, an interactive srun, a batch job)."""


def here_profile(profile: ClusterProfile) -> ClusterProfile:
    """The profile for `submit --here`: the components as srun steps on disjoint node sets of the
    allocation this shell holds (job_shape single), never requeued (the allocation is the user's)."""
    if profile.kind != "slurm":
        raise ConfigError.at("--here", profile.name, "runs the job's steps with srun inside a Slurm allocation: "
                             "give a Slurm profile")
    if not os.environ.get(HERE_ENV):
        raise ConfigError.at("--here", None, f"run it inside an allocation (salloc -N NODES ..., then "
                             f"slurm-align submit ... --here): {HERE_ENV} is not set in this shell")
    return profile.model_copy(update={"job_shape": "single", "requeue": False})


def launch_run(run: RunConfig, profile: ClusterProfile, run_dir: Path, *, follow: bool = False,
               entry: Entry = Entry(), console: Console | None = None, after: Sequence[str] = (),
               produced: Sequence[Path] = (), here: bool = False) -> Job:
    """Validate, render, write the run directory and start the job. Nothing is submitted on error.
    `after`: Slurm job ids this job starts after, each completed successfully (afterok; Slurm
    cancels this one when one of them fails); inputs they write (`produced_later`) may be missing now.
    `here`: run the job script in this shell's allocation (here_profile) instead of submitting it."""
    if here:
        if after:
            raise ConfigError.at("--after", ":".join(after), "not with --here (the allocation is running now)")
        profile = here_profile(profile)
    run, rd, script = prepare_launch(run, profile, run_dir, entry=entry, after=after, produced=produced)
    if here:
        need, have = sum(nodes_needed(profile, run.components).values()), os.environ.get("SLURM_JOB_NUM_NODES", "")
        if have.isdigit() and int(have) < need:
            parts = ", ".join(f"{c} {profile.resources(c).nodes}" for c in run.components)
            raise ConfigError.at("--here", f"allocation {os.environ[HERE_ENV]} of {have} nodes",
                                 f"the job needs {need} nodes ({parts}; its components never share a node): "
                                 "salloc at least that many")

    rd.logs.mkdir(parents=True, exist_ok=True)
    for comp in run.components:   # a resumed run's old exit codes must not be read as new ones
        (rd.logs / comp / "exit_code").unlink(missing_ok=True)
        for pattern in ("hang_rank*.json", "stacks_rank*.txt", "heartbeat_rank*.json"):   # profiling/watchdog.py
            for old_file in (rd.logs / comp).glob(pattern):
                old_file.unlink(missing_ok=True)
    # A new submission: its own requeue count, no stop request or failure of an earlier job.
    for old in (rd.logs / "cancelled", rd.first_failure, rd.requeue_count, rd.stop_requested, rd.stopped_step):
        old.unlink(missing_ok=True)
    write_atomic(rd.config, yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))
    write_atomic(rd.profile, yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    write_atomic(rd.script, script)
    setup = container_setup_text(profile)
    if setup is not None:
        write_atomic(rd.root / CONTAINER_SETUP, setup)
    create_run_secret(rd)   # mode 0600; the critic serves only requests carrying it
    for comp in run.components:   # an older start's addresses are never read as this one's
        rd.address(comp).unlink(missing_ok=True)

    popen = None
    if profile.kind == "local" or here:
        # The script in a session of its own: a Ctrl-C in this shell reaches slurm-align, which
        # asks the job to stop at a checkpoint (Job.stop), not the ranks directly. --here: its
        # srun steps run in the allocation SLURM_JOB_ID names (inherited from this shell).
        backend = "here" if here else "local"
        with open(rd.logs / f"job-{backend}.out", "ab") as out:   # the job keeps its own copy of the file
            popen = subprocess.Popen(["bash", str(rd.script)], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        job_id = f"local-{popen.pid}" if not here else f"{os.environ[HERE_ENV]}-here-{popen.pid}"
        record = JobRecord(backend, job_id, str(rd.root), list(run.components), profile.name, pid=popen.pid)
    else:
        job = HetjobExecutor(rd.root / "submitit", script, after=after).submit_script()
        record = JobRecord("slurm", str(job.job_id), str(rd.root), list(run.components), profile.name,
                           after=list(after))
    record.save()
    handle = Job(record, popen)
    if follow:
        handle.wait(console=console or Console(stderr=True))
    return handle


def find_job(job_or_run_dir: str) -> Job:
    """A Job from a run directory, or from a Slurm job id (searching ./runs for its record)."""
    path = Path(job_or_run_dir)
    if path.is_dir():
        return Job(JobRecord.load(path))
    for rec in Path("runs").glob("*/job.json"):
        data = json.loads(rec.read_text())
        if data.get("job_id") == job_or_run_dir:
            return Job(JobRecord(**data))
    if job_or_run_dir.isdigit():   # submitted elsewhere: ask Slurm alone
        return Job(JobRecord("slurm", job_or_run_dir, str(Path.cwd() / "runs" / "unknown"), ["job"], "?"))
    raise ConfigError.at("JOB", job_or_run_dir, "not a run directory, a known job id, or a Slurm job id")
