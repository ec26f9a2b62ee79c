"""The layout of a run directory, written down once.

    RUN_DIR/config.yaml            resolved run config
    RUN_DIR/profile.yaml           resolved cluster profile
    RUN_DIR/job.json               submission record (job id, components, script path)
    RUN_DIR/job.sbatch             the rendered script that was submitted
    RUN_DIR/logs/<component>/rank<N>.log
    RUN_DIR/rollouts.zarr          rollout store (PPO)
    RUN_DIR/traces.zarr            per-rank span traces
    RUN_DIR/eval/step_<N>.jsonl    per-prompt outcome of the held-out evaluation after step N (algorithms/evaluation.py)
    RUN_DIR/checkpoints/<name>/iter_<step>
    RUN_DIR/reports/<component>/rank<N>.json   what each rank reports about itself
    RUN_DIR/logs/<component>/exit_code, launcher.log; logs/first_failure
    RUN_DIR/stop_requested, stopped_step, requeue_count, preemption.jsonl   (preemption.py)
    RUN_DIR/run.secret             the run's secret (mode 0600), made at submit; critic requests carry it
    RUN_DIR/<component>_address.json  where a component's service listens (critic, generator), published by it
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def profile(self) -> Path:
        return self.root / "profile.yaml"

    @property
    def job_record(self) -> Path:
        return self.root / "job.json"

    @property
    def script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, component: str, rank: int | str) -> Path:
        return self.logs / component / f"rank{rank}.log"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.zarr"

    @property
    def traces(self) -> Path:
        return self.root / "traces.zarr"

    def eval_results(self, step: int) -> Path:
        """The per-prompt outcome of the held-out evaluation after `step` training steps (0: the
        initial policy); its rows are described in slurm_align/algorithms/evaluation.py."""
        return self.root / "eval" / f"step_{step}.jsonl"

    def eval_steps(self) -> list[int]:
        """The steps that have a per-prompt evaluation file, ascending."""
        return sorted(int(p.stem.removeprefix("step_")) for p in (self.root / "eval").glob("step_*.jsonl"))

    def checkpoints(self, name: str) -> Path:
        return self.root / "checkpoints" / name

    def report(self, component: str, rank: int) -> Path:
        return self.root / "reports" / component / f"rank{rank}.json"

    @property
    def secret(self) -> Path:
        """The run's secret: only this run's actor may call its critic (see create_run_secret)."""
        return self.root / "run.secret"

    def address(self, component: str) -> Path:
        """Where a component's service listens, published by it once it serves (publish_address)."""
        return self.root / f"{component}_address.json"

    @property
    def critic_address(self) -> Path:
        return self.address("critic")

    @property
    def critic_restart_requested(self) -> Path:
        """Written by the actor's critic client when tritonserver answered that a model's stub
        is unhealthy (its state is broken from then on); the critic's watchdog restarts it."""
        return self.root / "critic_restart_requested"

    @property
    def stop_requested(self) -> Path:
        """Written by the job script when Slurm warns the job (preemption, time limit)."""
        return self.root / "stop_requested"

    @property
    def stopped_step(self) -> Path:
        """The step the actor stopped (and saved) at for preemption."""
        return self.root / "stopped_step"

    @property
    def stopped_by(self) -> Path:
        """What stopped the actor: 'TERM' (Slurm ending the job's steps: preemption, cancel) or
        'warning' (the job script's stop_requested, USR2)."""
        return self.root / "stopped_by"

    @property
    def requeue_count(self) -> Path:
        """How often this submission was requeued, by the job script or by Slurm itself
        (SLURM_RESTART_COUNT, written by the job script at each start)."""
        return self.root / "requeue_count"

    @property
    def preemption_events(self) -> Path:
        """JSON lines: stop_requested, saved, requeued, resumed, first_step (with times)."""
        return self.root / "preemption.jsonl"

    @property
    def first_failure(self) -> Path:
        """Name of the component that failed first (written by the job script)."""
        return self.logs / "first_failure"

    def first_failed_component(self) -> str | None:
        """The component named in logs/first_failure, or None when none failed."""
        return self.first_failure.read_text().strip() if self.first_failure.is_file() else None

    def is_run_dir(self) -> bool:
        return self.config.is_file()


def new_run_dir(base: str | Path = "runs", name: str = "run") -> Path:
    """A fresh, not yet existing folder under `base`, named by time (no clobbering)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(base)
    for i in range(1000):
        cand = base / f"{name}-{stamp}" if i == 0 else base / f"{name}-{stamp}-{i}"
        if not cand.exists():
            return cand
    raise FileExistsError(f"no free run directory under {base}")


def write_atomic(path: Path, text: str) -> None:
    """Write to a temp file, fsync, then os.replace: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync a folder, so that renames and new entries in it survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))


# -- the run's secret and the critic's address ------------------------------------------------

class RunSecretError(RuntimeError):
    """The run's secret is missing or readable by others; the message names the file."""


def create_run_secret(rd: RunDir) -> None:
    """A fresh random secret in RUN_DIR/run.secret, mode 0600 from its creation on (never in the
    job script, the config or the environment). Replaces an older submission's secret."""
    rd.root.mkdir(parents=True, exist_ok=True)
    tmp = rd.secret.with_name(f".{rd.secret.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, rd.secret)


def read_run_secret(rd: RunDir) -> str:
    """The run's secret; refused when missing, empty, or readable by group or others."""
    try:
        fd = os.open(rd.secret, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RunSecretError(f"{rd.secret} is missing: every run launched by `slurm-align submit` "
                             "gets one; the critic serves only requests that carry it") from None
    except OSError as e:   # ELOOP: a symlink
        raise RunSecretError(f"{rd.secret} cannot be opened as a plain file: {e.strerror}") from None
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise RunSecretError(f"{rd.secret} has mode {mode:04o}: other users could read it; "
                                 f"it must be 0600 (chmod 600 {rd.secret})")
        secret = f.read().strip()
    if len(secret) < 32:
        raise RunSecretError(f"{rd.secret} holds no usable secret ({len(secret)} characters, at least 32 needed)")
    return secret


START_ENV = "SLURM_ALIGN_START"
"""Names the current start of the job: '<job id>:<restart count>' (the job script exports it;
a requeue by the script or by Slurm itself is a new start of the same job id)."""


def current_start() -> str:
    return os.environ.get(START_ENV, "")


def _address_tag(secret: str, component: str, host: str, port: int, start: str) -> str:
    # Proves the address was published by a holder of this submission's secret during this start
    # of the job: a client never sends the secret to an address left over from an older job, or
    # from the start before a requeue (whose host:port another process may hold by now).
    return hmac.new(secret.encode(), f"{component}-address {host}:{port} start {start}".encode(),
                    hashlib.sha256).hexdigest()


def publish_address(rd: RunDir, component: str, host: str, port: int, secret: str) -> None:
    """RUN_DIR/<component>_address.json: host, port, this start of the job and a tag keyed by the
    run's secret (only a holder of the secret can publish one that clients accept)."""
    start = current_start()
    write_atomic(rd.address(component), json.dumps({"host": host, "port": port, "start": start,
                                                    "tag": _address_tag(secret, component, host, port, start)}))


def address_problem(rd: RunDir, component: str, secret: str) -> tuple[tuple[str, int] | None, str]:
    """((host, port), "") for an address this run's `component` published during the current
    start; else (None, why not)."""
    path = rd.address(component)
    try:
        data = json.loads(path.read_text())
        host, port, tag = str(data["host"]), int(data["port"]), str(data["tag"])
        start = str(data.get("start", ""))
    except FileNotFoundError:
        return None, f"no address published in {path} yet"
    except (ValueError, KeyError, TypeError):
        return None, f"no address published in {path} yet (the file there is not one)"
    if not hmac.compare_digest(tag, _address_tag(secret, component, host, port, start)):
        return None, f"no address published in {path} yet (the one there is from another submission)"
    if start != current_start():
        return None, (f"no address published in {path} yet (the one there, {host}:{port}, is from start "
                      f"{start or '?'} of the job, this is start {current_start() or '?'}: not used)")
    return (host, port), ""


def publish_critic_address(rd: RunDir, host: str, port: int, secret: str) -> None:
    publish_address(rd, "critic", host, port, secret)


def critic_address_problem(rd: RunDir, secret: str) -> tuple[tuple[str, int] | None, str]:
    return address_problem(rd, "critic", secret)


def read_critic_address(rd: RunDir, secret: str) -> tuple[str, int] | None:
    """(host, port) published by this run's critic in this start of the job; None while there is
    none (or only a stale or foreign one)."""
    return address_problem(rd, "critic", secret)[0]
