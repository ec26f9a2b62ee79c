"""Sweeps: one (het)job per node count and/or per point of a grid of settings, a manifest in the
sweep directory, live progress.

    slurm-align sweep CONFIG --profile NAME --nodes 1,2,4,8 [--mode weak|strong]
    slurm-align sweep CONFIG --profile NAME --set ppo.actor_lr=1e-6,5e-6 --set rl.n_samples_per_prompt=4,8
    slurm-align analyze settings SWEEP_DIR --metric val/score --metric timers/step

`--set KEY=V1,V2,...` (repeatable) makes a grid over dotted run-config overrides: every
combination is a point (with --nodes, at every node count; without, at the profile's own nodes),
each checked as a run config before anything starts.

`--nodes` gives the actor's node counts; every other component the run declares is scaled as its
kind says (config/components.py): the critic's follow `sweep.actor_to_critic_nodes` in the run
config (PPO's critic, and the reward-only critic of GRPO/RLOO/... with a reward model), the others
(the generator, a teacher, ...) keep the profile's ratio to the actor, rounded up. Each
component's data_parallel is set so TP x PP x DP equals its ranks (nodes x tasks_per_node of the
profile). Weak scaling grows what the run's algorithm trains on, in proportion to the actor
nodes, from the config's value at the smallest point: for the rollout algorithms (ppo, grpo,
rloo, ...) the prompts per step (ppo.num_rollout_samples) and, when set, ppo.global_batch_size
(so the optimizer steps per step stay the same); for sft/rm/dpo trainer.global_batch_size.
Strong scaling keeps them. Every point records every component's nodes. A point that fails to
launch or to run is recorded and the others go on. The manifest (sweep.json) is rewritten
atomically after every change of state.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from slurm_align.config.components import component_kind
from slurm_align.config.errors import ConfigError
from slurm_align.config.loading import apply_overrides, validate
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import RunConfig
from slurm_align.rundir import write_atomic
from slurm_align.slurm import state as job_state
from slurm_align.slurm.capacity import check_fits_cluster
from slurm_align.slurm.launch import Job, launch_run
from slurm_align.slurm.render import Entry
from slurm_align.slurm.status import failing_rank

MANIFEST = "sweep.json"
FORMAT = "slurm-align-sweep/1"
PLANNED, LAUNCH_FAILED = "PLANNED", "LAUNCH_FAILED"
FINAL = (*job_state.FINAL_STATES, LAUNCH_FAILED, job_state.UNKNOWN)
UNKNOWN_POLLS = 5
"""Consecutive polls in which Slurm does not know a job before its point is given up (one
can be a slow scontrol; a job Slurm forgot would otherwise be polled forever)."""


def parse_nodes(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (ascending, unique, positive)."""
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError.at("--nodes", text, "a comma list of positive node counts, e.g. 1,2,4,8") from None
    if not nodes or min(nodes) < 1 or len(set(nodes)) != len(nodes):
        raise ConfigError.at("--nodes", text, "a comma list of distinct positive node counts, e.g. 1,2,4,8")
    return sorted(nodes)


def parse_set(text: str) -> tuple[str, list[str]]:
    """'ppo.actor_lr=1e-6,5e-6' -> ('ppo.actor_lr', ['1e-6', '5e-6'])."""
    key, sep, raw = text.partition("=")
    values = [v.strip() for v in raw.split(",")]
    if not sep or not key or any(not part for part in key.split(".")) or not all(values):
        raise ConfigError.at("--set", text, "KEY=V1,V2,... with a dotted run-config field, e.g. ppo.actor_lr=1e-6,5e-6")
    if len(set(values)) != len(values):
        raise ConfigError.at("--set", text, "each value once")
    return key, values


def settings_grid(sets: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination of the --set values, the first --set varying slowest."""
    keys = [k for k, _ in sets]
    if len(set(keys)) != len(keys):
        raise ConfigError.at("--set", ", ".join(keys), "each field once (give all its values in one --set)")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in sets))]


def parse_ratio(text: str) -> tuple[int, int]:
    a, _, c = text.partition(":")
    return int(a), int(c)


def critic_nodes_for(actor_nodes: int, ratio: str) -> int:
    a, c = parse_ratio(ratio)
    return max(1, math.ceil(actor_nodes * c / a))


def _data_parallel(run: RunConfig, comp: str, ranks: int, nodes: int) -> int:
    par = run.parallel(comp)
    mp = par.tensor_parallel * par.pipeline_parallel
    if ranks % mp:
        raise ConfigError.at(
            f"{comp}.tensor_parallel x pipeline_parallel", mp,
            f"must divide the {ranks} ranks of {nodes} {comp} node(s) at this sweep point")
    return ranks // mp


@dataclass(frozen=True)
class SweepPoint:
    nodes: int
    critic_nodes: int
    run: RunConfig
    profile: ClusterProfile
    settings: tuple[tuple[str, str], ...] = ()
    """The --set values of this point (empty in a sweep over node counts alone)."""

    @property
    def batch(self) -> int:
        return _batch(self.run)

    @property
    def component_nodes(self) -> dict[str, int]:
        return {c: self.profile.resources(c).nodes for c in self.run.components}

    @property
    def name(self) -> str:
        tags = "".join(f"-{k.rsplit('.', 1)[-1]}{v}" for k, v in self.settings)
        return re.sub(r"[^\w.+-]", "_", f"nodes{self.nodes}{tags}")


def _batch(run: RunConfig) -> int:
    """The batch a weak-scaling sweep scales: the registered algorithm's sweep_batch field."""
    section, field = run.spec.sweep_batch.split(".")
    return getattr(getattr(run, section), field)


def plan_point(run: RunConfig, profile: ClusterProfile, nodes: int, base_nodes: int, mode: str) -> SweepPoint:
    """The run config and profile of one point (pure: nothing is written)."""
    if mode not in ("weak", "strong"):
        raise ConfigError.at("--mode", mode, "allowed: weak, strong")
    resources = dict(profile.components)
    comps: dict[str, int] = {}
    update: dict = {}
    for comp in run.components:   # every declared component, each scaled as its kind says
        kind = component_kind(comp)
        if kind.resource_key not in resources:
            raise ConfigError([f"profile '{profile.name}' has no resources for component '{kind.resource_key}'"])
        n = comps[comp] = kind.nodes_at(run, profile, nodes)
        res = resources[kind.resource_key].model_copy(update={"nodes": n})
        resources[kind.resource_key] = res
        if kind.parallel_field:
            par = run.parallel(comp)
            update[kind.parallel_field] = par.model_copy(
                update={"data_parallel": _data_parallel(run, comp, res.ranks, n)})
    if mode == "weak":
        base = _batch(run)
        gbs = run.ppo.global_batch_size if run.spec.rollout else None
        for value in (base, gbs or 0):
            if (value * nodes) % base_nodes:
                raise ConfigError.at("--nodes", nodes, f"weak scaling needs batch {value} x {nodes} / {base_nodes} "
                                     "to be whole: use node counts that are multiples of the smallest")
        section, field = run.spec.sweep_batch.split(".")   # the algorithm's batch field
        update[section] = getattr(run, section).model_copy(update={field: base * nodes // base_nodes})
        if gbs is not None:   # the same number of optimizer steps per step at every point
            update["ppo"] = update.get("ppo", run.ppo).model_copy(
                update={"global_batch_size": gbs * nodes // base_nodes})
    new_run = run.model_copy(update=update)
    new_profile = profile.model_copy(update={"components": resources})
    return SweepPoint(nodes, comps.get("critic", 0), new_run, new_profile)


def plan_sweep(run: RunConfig, profile: ClusterProfile, nodes: list[int] | None, mode: str,
               sets: list[tuple[str, list[str]]] | None = None) -> list[SweepPoint]:
    """The points: every --set combination (one, without --set) at every node count (the
    profile's own actor nodes, without --nodes: then the node counts are left as they are)."""
    points = []
    for combo in settings_grid(sets or []):
        source = "--set " + " ".join(f"{k}={v}" for k, v in combo.items())
        point_run = validate(RunConfig, apply_overrides(run.model_dump(mode="json"), [f"{k}={v}" for k, v in
                                                                                       combo.items()], source), source)
        settings = tuple(combo.items())
        if nodes is None:
            comps = {c: profile.resources(c).nodes for c in point_run.components}
            points.append(SweepPoint(comps.get("actor", 0), comps.get("critic", 0), point_run, profile, settings))
            continue
        for n in sorted(nodes):
            p = plan_point(point_run, profile, n, min(nodes), mode)
            points.append(SweepPoint(p.nodes, p.critic_nodes, p.run, p.profile, settings))
    return points


@dataclass
class ManifestPoint:
    nodes: int
    critic_nodes: int
    rollout_samples: int
    run_dir: str
    """Relative to the sweep directory."""
    state: str = PLANNED
    job_id: str | None = None
    error: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    component_nodes: dict[str, int] = field(default_factory=dict)
    """Nodes of every component of the point's job ({'actor': 4, 'critic': 2}); last, so the
    positional fields keep their order."""
    settings: dict[str, str] = field(default_factory=dict)
    """The point's --set values ({'ppo.actor_lr': '1e-6'}); empty in a sweep over node counts."""


@dataclass
class Manifest:
    sweep_dir: Path
    config: str
    profile: str
    mode: str
    points: list[ManifestPoint] = field(default_factory=list)
    created: str = field(default_factory=lambda: dt.datetime.now().isoformat(timespec="seconds"))

    def save(self) -> None:
        data = {"format": FORMAT, **{k: v for k, v in asdict(self).items() if k != "sweep_dir"}}
        write_atomic(self.sweep_dir / MANIFEST, json.dumps(data, indent=1))

    @classmethod
    def load(cls, sweep_dir: Path) -> Manifest:
        path = Path(sweep_dir) / MANIFEST
        if not path.is_file():
            raise ConfigError([f"not a sweep directory: {MANIFEST} is missing (make one with "
                               "`slurm-align sweep CONFIG --nodes ...`)"], sweep_dir)
        data = json.loads(path.read_text())
        if data.pop("format", None) != FORMAT:
            raise ConfigError([f"{MANIFEST} is not a slurm-align sweep manifest ({FORMAT})"], path)
        points = [ManifestPoint(**p) for p in data.pop("points")]
        return cls(Path(sweep_dir), points=points, **data)

    def run_path(self, pt: ManifestPoint) -> Path:
        return self.sweep_dir / pt.run_dir


def _table(manifest: Manifest) -> Table:
    t = Table(title=f"sweep {manifest.sweep_dir} ({manifest.mode})")
    for col in ("nodes per component", "batch", "settings", "job", "state", "elapsed", "note"):
        t.add_column(col)
    now = time.time()
    for p in manifest.points:
        elapsed = "" if p.started_at is None else f"{(p.ended_at or now) - p.started_at:.0f} s"
        color = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow"}.get(p.state, "red")
        if p.state == PLANNED:
            color = "white"
        nodes = " ".join(f"{c} {n}" for c, n in p.component_nodes.items()) or str(p.nodes)
        t.add_row(nodes, str(p.rollout_samples),
                  " ".join(f"{k}={v}" for k, v in p.settings.items()), p.job_id or "",
                  f"[{color}]{p.state}[/]", elapsed, (p.error or "")[:80])
    return t


def run_sweep(points: list[SweepPoint], manifest: Manifest, *, entry=None, max_concurrent: int | None = None,
              console: Console | None = None, poll_s: float = 1.0) -> Manifest:
    """Launch every point (at most max_concurrent at once), follow them to the end, keep the
    manifest current. Returns the manifest; failed points carry their error."""
    console = console or Console(stderr=True)
    limit = max_concurrent or len(points)
    jobs: dict[int, Job] = {}
    unknown: dict[int, int] = {}   # consecutive polls in which Slurm did not know the job
    todo = list(range(len(points)))
    with Live(_table(manifest), console=console, refresh_per_second=2) as live:
        while todo or jobs:
            while todo and len(jobs) < limit:
                i = todo.pop(0)
                pt, mp = points[i], manifest.points[i]
                mp.started_at = time.time()
                try:
                    job = launch_run(pt.run, pt.profile, manifest.run_path(mp), entry=entry or Entry())
                except Exception as e:  # one bad point must not stop the sweep
                    mp.state, mp.error, mp.ended_at = LAUNCH_FAILED, f"{type(e).__name__}: {e}", time.time()
                else:
                    jobs[i], mp.job_id, mp.state = job, job.job_id, "PENDING"
                manifest.save()
            for i, job in list(jobs.items()):
                mp = manifest.points[i]
                try:
                    state = job.state()
                except Exception as e:  # a flaky squeue call: try again next round
                    mp.error = f"state query failed: {e}"
                    continue
                unknown[i] = unknown.get(i, 0) + 1 if state == job_state.UNKNOWN else 0
                if state == job_state.UNKNOWN and unknown[i] < UNKNOWN_POLLS:
                    continue
                if state != mp.state:
                    mp.state = state
                    if state in FINAL:
                        mp.ended_at = time.time()
                        del jobs[i]
                        if state != job_state.COMPLETED:
                            mp.error = _failure_note(job, state, manifest.run_path(mp))
                    manifest.save()
            live.update(_table(manifest))
            if jobs:
                time.sleep(poll_s)
        live.update(_table(manifest))
    return manifest


def _failure_note(job, state: str, run_dir: Path) -> str:
    """What the manifest keeps about a point that did not complete: its state, the component
    and rank that failed first with the last line of its log, and where the logs are."""
    note = state
    if state == job_state.UNKNOWN:
        note += " (Slurm no longer knows the job)"
    first = job.run_dir.first_failed_component()
    comps = [first] if first else list(job.failed_logs())
    if comps:
        f = failing_rank(job.run_dir, comps[0], lines=1)
        note += f"; {f.component} rank {f.rank} failed first ({f.why}): {' '.join(f.tail)[:200]}"
    return f"{note}; logs: {run_dir / 'logs'}"


def start_sweep(run: RunConfig, profile: ClusterProfile, nodes: list[int] | None, mode: str, sweep_dir: Path,
                config_path: str, sets: list[tuple[str, list[str]]] | None = None, **kwargs) -> Manifest:
    """Plan (all errors before anything starts), write the manifest, then run every point."""
    points = plan_sweep(run, profile, nodes, mode, sets)
    problems = []
    for p in points:   # a point that could never start would stay PENDING forever
        try:
            check_fits_cluster(p.profile, p.run.components, what=f"the point with {p.nodes} actor node(s)")
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError([*problems, "drop these node counts from --nodes"], f"profile '{profile.name}'")
    sweep_dir = Path(sweep_dir).resolve()
    if (sweep_dir / MANIFEST).exists():
        raise ConfigError.at("--sweep-dir", str(sweep_dir), "already holds a sweep; choose a new folder")
    manifest = Manifest(sweep_dir, str(config_path), profile.name, mode, [
        ManifestPoint(p.nodes, p.critic_nodes, p.batch, p.name, component_nodes=p.component_nodes,
                      settings=dict(p.settings)) for p in points])
    manifest.save()
    return run_sweep(points, manifest, **kwargs)
