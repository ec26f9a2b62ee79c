"""Pipelines: a run's stages (SFT -> RM -> PPO, ...) queued at once, chained by Slurm dependencies.

    slurm-align pipeline PIPELINE.yaml --profile NAME [--run-dir DIR]
    slurm-align status DIR                 # every stage
    slurm-align pipeline --resume DIR      # requeue what did not complete

PIPELINE.yaml (examples/pipeline_tiny.yaml):

    stages:
      sft: {config: sft_tiny.yaml}
      rm:  {config: rm_tiny.yaml}
      ppo:
        config: ppo_tiny.yaml
        overrides: ["model.init_checkpoint={sft.checkpoint}", "critic_model.init_checkpoint={rm.checkpoint}"]

Each stage is a run config (a path relative to the pipeline file) with dotted overrides, and
optionally dotted overrides of the profile for that stage alone (`profile: [partition=preemptible,
requeue=true]`: a stage that may be preempted, a bigger allocation, ...). A stage
names an earlier stage's outputs as `{stage.checkpoint}` (its checkpoint folder, whose newest
complete iteration the stage loads when it starts) or `{stage.run_dir}`; each stage it names,
and each in its `after` list, must complete successfully before it starts (`afterok`), and Slurm
cancels it when one of them fails (`--kill-on-invalid-dep=yes`). Every stage is checked before
the first is queued; the command returns once all are queued (the login shell may exit). A
stage preempted and requeued keeps its job id, so its dependents wait for it to complete. A stage
restarted on failure (fault_tolerance.max_restarts) is a new job: slurm/restart.py moves its
dependents' `afterok` onto the new job before the failed one ends (so Slurm does not cancel
them) and records the new id here.

DIR/<stage>/ is each stage's run directory; DIR/pipeline.json records the stages, their job ids
and dependencies (rewritten atomically after each submission); DIR/profile.yaml the pipeline's
profile (each stage's own, with its overrides, is in its run directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pydantic
import yaml
from pydantic import Field

from slurm_align.config.base import StrictModel
from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import apply_overrides, load_run_config, read_yaml, validate
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.rundir import RunDir, write_atomic
from slurm_align.slurm import state as job_state
from slurm_align.slurm.launch import Job, JobRecord, launch_run, prepare_launch
from slurm_align.slurm.render import Entry
from slurm_align.slurm.status import latest_step

RECORD = "pipeline.json"
PROFILE = "profile.yaml"
FORMAT = "slurm-align-pipeline/1"
OUTPUTS = ("checkpoint", "run_dir")
_REF = re.compile(r"\{([^{}.]+)\.([^{}]+)\}")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
NOT_SUBMITTED = "NOT_SUBMITTED"


class StageSpec(StrictModel):
    config: Path
    """Run config YAML of the stage; a relative path is taken from the pipeline file's folder."""
    overrides: list[str] = Field(default_factory=list)
    """Dotted overrides (a.b=c) on top of the config; `{stage.checkpoint}`, `{stage.run_dir}` name
    an earlier stage's outputs (and make this stage wait for it)."""
    after: list[str] = Field(default_factory=list)
    """Earlier stages this one waits for besides those its overrides name."""
    profile: list[str] = Field(default_factory=list)
    """Dotted overrides (a.b=c) of the pipeline's profile for this stage alone, e.g.
    `partition=preemptible`, `requeue=true`, `components.actor.nodes=4`."""


class PipelineSpec(StrictModel):
    stages: dict[str, StageSpec]
    """The stages in order of submission: a stage may refer only to stages above it."""


@dataclass
class StageRecord:
    name: str
    run_dir: str
    after: list[str]                 # stage names
    job_id: str | None = None        # None: not queued (yet)


@dataclass
class PipelineRecord:
    spec: str                        # the pipeline file, absolute
    profile: str
    stages: list[StageRecord] = field(default_factory=list)
    format: str = FORMAT

    def save(self, root: Path) -> None:
        write_atomic(root / RECORD, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, root: Path) -> PipelineRecord:
        path = root / RECORD
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError.at("PIPELINE_DIR", str(root), f"not a pipeline directory ({RECORD} missing)") from None
        data["stages"] = [StageRecord(**s) for s in data["stages"]]
        return cls(**data)


@contextlib.contextmanager
def locked_record(root: Path) -> Iterator[PipelineRecord]:
    """The record, loaded and saved again under an exclusive lock of DIR/pipeline.json.lock: the
    restart epilogues of two stages (slurm/restart.py) may rewrite it at the same time."""
    with open(root / f"{RECORD}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = PipelineRecord.load(root)
        yield record
        record.save(root)


def is_pipeline_dir(path: Path) -> bool:
    return (Path(path) / RECORD).is_file()


def checkpoint_folder(run: RunConfig, run_dir: Path) -> Path:
    """Where a stage's checkpoints go: checkpoints/actor for the rollout algorithms (PPO, GRPO,
    ...), checkpoints/<algorithm> for the trainers (sft, rm, dpo; algorithms/trainer.py)."""
    return RunDir(run_dir).checkpoints("actor" if run.spec.rollout else run.algorithm)


def stage_profile(profile: ClusterProfile, spec: PipelineSpec, name: str, path: Path) -> ClusterProfile:
    """The pipeline's profile with the stage's `profile` overrides; checked as a profile is, the
    error naming the stage's field. A stage stays a Slurm job (dependencies chain Slurm jobs)."""
    overrides = spec.stages[name].profile
    if not overrides:
        return profile
    where = f"stages.{name}.profile"
    data = apply_overrides(profile.model_dump(mode="json"), list(overrides), source=f"{path} ({where})")
    try:
        out = ClusterProfile.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError.from_validation(e, path, prefix=where) from None
    if out.kind != "slurm" or out.name != profile.name:
        field_, value = ("kind", out.kind) if out.kind != "slurm" else ("name", out.name)
        raise ConfigError.at(f"{where}.{field_}", value, "a stage overrides its profile's settings, not which "
                             "profile it is: the pipeline's stages are Slurm jobs of one profile", path)
    return out


def load_pipeline(path: Path) -> PipelineSpec:
    spec = validate(PipelineSpec, read_yaml(path), path)
    if not spec.stages:
        raise ConfigError.at("stages", {}, "give at least one stage (name: {config: RUN.yaml})", path)
    for name in spec.stages:
        if not _NAME.match(name):
            raise ConfigError.at(f"stages.{name}", name, "a stage name is a letter then letters, digits, _ or -",
                                 path)
    return spec


def _resolve(path: Path, spec: PipelineSpec, root: Path) -> tuple[dict[str, RunConfig], dict[str, list[str]]]:
    """Each stage's run config with its references replaced, and the stages each waits for.
    References and `after` may name only earlier stages: the order in the file is the order of
    submission, and a dependency on a later job cannot be expressed."""
    runs: dict[str, RunConfig] = {}
    deps: dict[str, list[str]] = {}
    for name, stage in spec.stages.items():
        earlier = list(runs)
        waits: list[str] = []

        def need(other: str, where: str, value: str, earlier: list[str] = earlier, waits: list[str] = waits) -> None:
            if other not in earlier:
                raise ConfigError.at(where, value, f"names stage {other!r}; a stage may refer only to the stages "
                                     f"above it: {', '.join(earlier) or 'none (it is the first)'}", path)
            if other not in waits:
                waits.append(other)

        overrides = []
        for i, item in enumerate(stage.overrides):
            where = f"stages.{name}.overrides[{i}]"
            for m in _REF.finditer(item):
                need(m.group(1), where, item)
                if m.group(2) not in OUTPUTS:
                    raise ConfigError.at(where, item, f"output {m.group(2)!r} of a stage is not known; allowed: "
                                         f"{', '.join('{stage.' + o + '}' for o in OUTPUTS)}", path)

            def output(m: re.Match) -> str:
                other = m.group(1)
                out_dir = root / other
                return str(checkpoint_folder(runs[other], out_dir) if m.group(2) == "checkpoint" else out_dir)
            overrides.append(_REF.sub(output, item))
        for i, other in enumerate(stage.after):
            need(other, f"stages.{name}.after[{i}]", other)
        config = stage.config if stage.config.is_absolute() else path.parent / stage.config
        runs[name] = load_run_config(config, overrides)
        deps[name] = waits
    return runs, deps


def submit_pipeline(path: Path, profile: ClusterProfile, root: Path,
                    entries: Mapping[str, Entry] | None = None) -> PipelineRecord:
    """Check every stage, then queue them in order, each after the stages it waits for.
    `entries`: per stage, what its ranks run when not the stock launchers (tests inject faults)."""
    path, root = Path(path).resolve(), Path(root).resolve()
    spec = load_pipeline(path)
    if profile.kind != "slurm":
        raise ConfigError.at("--profile", profile.name, "a pipeline chains Slurm jobs: give a Slurm profile "
                             "(on the local profile, run the stages one after another with --follow)")
    if is_pipeline_dir(root):
        raise ConfigError.at("--run-dir", str(root), "already holds a pipeline: resume it with "
                             "`slurm-align pipeline --resume DIR`, or choose another directory")
    runs, deps = _resolve(path, spec, root)
    profiles = {name: stage_profile(profile, spec, name, path) for name in runs}
    entries = dict(entries or {})
    for name, run in runs.items():   # everything is checked before anything is queued
        prepare_launch(run, profiles[name], root / name, entry=entries.get(name, Entry()),
                       produced=[root / d for d in deps[name]])
    record = PipelineRecord(str(path), profile.name, [StageRecord(n, str(root / n), deps[n]) for n in runs])
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / PROFILE, yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    _queue(record, runs, profiles, root, entries)
    return record


def _queue(record: PipelineRecord, runs: dict[str, RunConfig], profiles: dict[str, ClusterProfile], root: Path,
           entries: Mapping[str, Entry] | None = None) -> None:
    """Submit the stages in `runs` (in record order), each on its profile, recording each job id
    as it is queued, so that a failure half way leaves a record of what is queued."""
    root.mkdir(parents=True, exist_ok=True)
    jobs = {s.name: s.job_id for s in record.stages}
    for stage in record.stages:
        if stage.name not in runs:
            continue
        # A dependency that already completed is not named: Slurm forgets old jobs, and
        # afterok on a forgotten job id is refused.
        after = [jobs[d] for d in stage.after if _stage_state(record, d) != job_state.COMPLETED]
        assert all(a is not None for a in after), "stages are queued in order"
        job = launch_run(runs[stage.name], profiles[stage.name], Path(stage.run_dir), after=[str(a) for a in after],
                         produced=[root / d for d in stage.after], entry=(entries or {}).get(stage.name, Entry()))
        stage.job_id = jobs[stage.name] = job.job_id
        record.save(root)


def _stage_state(record: PipelineRecord, name: str) -> str:
    stage = next(s for s in record.stages if s.name == name)
    return stage_state(stage)


def stage_state(stage: StageRecord) -> str:
    if stage.job_id is None or not RunDir(Path(stage.run_dir)).job_record.is_file():
        return NOT_SUBMITTED
    job = Job(JobRecord.load(Path(stage.run_dir)))
    if job.job_id != stage.job_id:   # resubmitted by hand (submit --resume): the newest job counts
        stage.job_id = job.job_id
    return job.state()


def resume_pipeline(root: Path, profile_overrides: list[str] | None = None) -> tuple[PipelineRecord, list[str]]:
    """Queue again the stages that did not complete (failed, cancelled, stopped, never queued),
    each after its dependencies that are not complete yet. A stage with checkpoints resumes
    from its newest one (its run directory is reused). Returns the record and the stages queued."""
    root = Path(root).resolve()
    record = PipelineRecord.load(root)
    # The pipeline's own profile; a pipeline queued before it was kept: a stage's (which holds
    # that stage's overrides too, applied again below anyway).
    profile_path = root / PROFILE if (root / PROFILE).is_file() else next(
        (RunDir(Path(s.run_dir)).profile for s in record.stages if RunDir(Path(s.run_dir)).profile.is_file()), None)
    if profile_path is None:
        raise ConfigError.at("--resume", str(root), "no stage was ever queued: submit the pipeline again")
    profile = validate(ClusterProfile, apply_overrides(read_yaml(profile_path), list(profile_overrides or [])),
                       profile_path)
    states = {s.name: stage_state(s) for s in record.stages}
    redo = [n for n, st in states.items()
            if st in (job_state.FAILED, job_state.CANCELLED, job_state.STOPPED, NOT_SUBMITTED, job_state.UNKNOWN)]
    # A stage that waits for one being queued again is queued again too: Slurm cancelled it
    # (or will), and its old job id cannot wait for the new one.
    for stage in record.stages:
        if stage.name not in redo and any(d in redo for d in stage.after) and states[stage.name] != job_state.COMPLETED:
            if states[stage.name] in (job_state.PENDING, job_state.RUNNING):
                Job(JobRecord.load(Path(stage.run_dir))).cancel()
            redo.append(stage.name)
    spec = load_pipeline(Path(record.spec))
    spec_runs, _ = _resolve(Path(record.spec), spec, root)
    runs = {}
    for name in [s.name for s in record.stages if s.name in redo]:
        rd = RunDir(root / name)
        # The stage's own resolved config where it was written (a resumed run keeps its settings),
        # else the pipeline file's.
        runs[name] = validate(RunConfig, read_yaml(rd.config), rd.config) if rd.config.is_file() else spec_runs[name]
    profiles = {name: stage_profile(profile, spec, name, Path(record.spec)) for name in runs}
    for name in runs:
        prepare_launch(runs[name], profiles[name], root / name,
                       produced=[root / d for d in next(s for s in record.stages if s.name == name).after])
    _queue(record, runs, profiles, root)
    return record, list(runs)


@dataclass
class StageStatus:
    name: str
    job_id: str | None
    state: str
    after: list[str]
    run_dir: str
    last_checkpoint_step: int | None
    why: str = ""


def pipeline_status(root: Path) -> list[StageStatus]:
    """Every stage's state; a stage Slurm cancelled because a stage it waits for failed says so."""
    record = PipelineRecord.load(Path(root))
    out: list[StageStatus] = []
    states: dict[str, str] = {}
    for stage in record.stages:
        st = states[stage.name] = stage_state(stage)
        why = ""
        failed_deps = [d for d in stage.after if states.get(d) in (job_state.FAILED, job_state.CANCELLED,
                                                                    job_state.STOPPED)]
        if st == job_state.CANCELLED and failed_deps:
            why = "cancelled by Slurm: " + ", ".join(f"stage {d} ended {states[d]}" for d in failed_deps) + \
                  f" (resume with `slurm-align pipeline --resume {root}`)"
        elif st == job_state.PENDING and stage.after:
            waiting = [d for d in stage.after if states.get(d) != job_state.COMPLETED]
            if waiting:
                why = "waits for stage " + ", ".join(waiting)
        elif st == job_state.FAILED:
            why = f"see `slurm-align status {stage.run_dir}`"
        ckpt_root = Path(stage.run_dir) / "checkpoints"
        steps = [s for d in (ckpt_root.iterdir() if ckpt_root.is_dir() else []) if (s := latest_step(d)) is not None]
        out.append(StageStatus(stage.name, stage.job_id, st, stage.after, stage.run_dir,
                               max(steps) if steps else None, why))
    return out


def follow_restart(run_dir: Path, old_id: str, new_id: str, env: Mapping[str, str] | None = None) -> list[str]:
    """A pipeline stage's job `old_id`, still running, was resubmitted as `new_id` (restart on
    failure, slurm/restart.py). Its dependents wait on `afterok:old_id`, and Slurm cancels them once
    it ends FAILED (`--kill-on-invalid-dep=yes`): before then, each pending dependent's dependency
    is moved onto the new job (`scontrol update JobId=... Dependency=afterok:...`), and
    pipeline.json records the new id. Returns one line per dependent (moved, or why not); nothing
    when `run_dir` is not a stage of a pipeline."""
    run_dir = Path(run_dir).resolve()
    root = run_dir.parent
    if not is_pipeline_dir(root):
        return []
    out = []
    with locked_record(root) as record:
        stage = next((s for s in record.stages if Path(s.run_dir) == run_dir), None)
        if stage is None:
            return []
        stage.job_id = new_id
        for dep in record.stages:
            if stage.name not in dep.after or not RunDir(Path(dep.run_dir)).job_record.is_file():
                continue
            job = JobRecord.load(Path(dep.run_dir))
            if old_id not in job.after:   # queued after this stage's job ended (a resume): not ours
                continue
            # The other jobs it waits for stay; one Slurm already saw complete may be forgotten
            # by now (MinJobAge), and an update naming it would be refused.
            after = [new_id if a == old_id else a for a in job.after
                     if a == old_id or job_state.slurm_state(a)[0] != job_state.COMPLETED]
            done = subprocess.run(["scontrol", "update", f"JobId={job.job_id}",
                                   f"Dependency=afterok:{':'.join(after)}"],
                                  capture_output=True, text=True, env=None if env is None else dict(env))
            if done.returncode != 0:
                out.append(f"stage {dep.name} (job {job.job_id}) not moved: "
                           f"{done.stderr.strip() or done.returncode}")
                continue
            job.after = after
            job.save()
            out.append(f"stage {dep.name} (job {job.job_id}) now waits for job {new_id}")
    return out
