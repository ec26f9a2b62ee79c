"""The registry of component kinds: what a run's job is made of.

A run's job is one heterogeneous Slurm job (or, on the local profile, one mpirun process group
per component). Each component is a *kind* registered here; the run declares which kinds it
needs (`RunConfig.components` asks every registered kind, in registration order, which is also
the het-group order), and everything that treats components (the job script, the sweep, the
preemption roles, `status`, the checks against the profile) looks the kind up here instead of
naming actor, critic and generator.

Adding a component is one module that runs its ranks plus one registration:

    from slurm_align.config.components import ComponentKind, register_component, rollout_job

    register_component(ComponentKind(
        name="judge",                                   # also its profile key and log folder
        launcher="slurm_align.launchers.judge",         # `python -u -m <launcher> --run-dir RUN_DIR` on every rank
        declared_by=lambda run: rollout_job(run) and run.reward.judge is not None,
        serves=True,                                    # publishes RUN_DIR/judge_address.json
        preemption="survives",                          # serves on after a TERM until the leader saved
    ))

Put it in this module for a built-in kind, or in a module the run lists under `plugins:` (the
run config imports those while it is validated, in the submitting process and in every rank,
so the kind is known wherever the config is). The launcher module, on each rank:

- calls `slurm_align.slurm.preemption.block_term()` first (before MPI, torch or threads), then
  `slurm_align.slurm.preemption.enter_role(kind, rd)` for its preemption role;
- if `serves`: binds where `slurm_align.critic.main.service_host(name, bind_host)` says, and
  publishes its address with `slurm_align.rundir.publish_address(rd, name, host, port, secret)`
  (secret: `read_run_secret(rd)`); a client reads it with `rundir.address_problem(rd, name,
  secret)`, which accepts only an address this submission published during this start of the job.
  The job script removes `RUN_DIR/<name>_address.json` at every start. A server of tensors reuses
  the critic's secured PyTriton channel (slurm_align/critic/server.py, channel.py), which refuses
  requests without the run's secret, instead of starting a server of its own.

Fields of ComponentKind (all but name, launcher and declared_by have defaults):

- `resources`: the key of its resources in the profile's `components:` (default: its name);
- `parallel_field`: the RunConfig field holding its ParallelConfig (tensor x pipeline x data must
  equal the profile's ranks; a sweep sets its data_parallel); None: its ranks are whatever the
  profile gives, laid out by the component itself;
- `serves`: see above;
- `preemption`: `leads` (the actor: its ranks agree on a stop point and save every role; one kind
  only), `follows` (driven by the leader: Slurm's USR2 ignored, ended by the script once the leader
  stopped), `survives` (a server: a TERM from Slurm's preemption is not its end, it serves on
  until the leader stopped, then exits 0);
- `sweep_nodes(run, profile, leader_nodes) -> nodes`: its node count at a sweep point where the
  leader has `leader_nodes`; default (None): the profile's ratio to the leader kept, rounded up,
  at least 1. A sweep scales every declared component;
- `lost_peer`: a regular expression matching the error a *client* of this component logs when
  the component went away; `status` then reads the client's failure as a consequence and names
  this component's failing rank instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:   # the run config imports this module; only types are needed here
    from slurm_align.config.profile import ClusterProfile
    from slurm_align.config.run import RunConfig

PreemptionRole = Literal["leads", "follows", "survives"]
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ComponentKind:
    name: str
    """Component name: the profile's resource key (unless `resources`), logs/<name>/, the het-group's name."""
    launcher: str
    """Module every rank runs as `python -u -m <launcher> --run-dir RUN_DIR` (rollout algorithms;
    the trainers' single component runs slurm_align.launchers.train)."""
    declared_by: Callable[[RunConfig], bool]
    """Whether a run needs this component."""
    resources: str | None = None
    """Key of its resources in the profile's `components:`; default: the name."""
    parallel_field: str | None = None
    """RunConfig field holding its ParallelConfig; None: the component lays out its own ranks."""
    serves: bool = False
    """Publishes a secret-tagged address (RUN_DIR/<name>_address.json) that its clients read."""
    preemption: PreemptionRole = "follows"
    """leads | follows | survives (module docstring)."""
    sweep_nodes: Callable[[RunConfig, ClusterProfile, int], int] | None = None
    """Its nodes at a sweep point, given the leader's; None: the profile's ratio to the leader."""
    lost_peer: str | None = None
    """Regex of a client's error when this component went away (status: a consequence)."""

    @property
    def resource_key(self) -> str:
        return self.resources or self.name

    def nodes_at(self, run: RunConfig, profile: ClusterProfile, leader_nodes: int) -> int:
        """Its node count at a sweep point where the leader has `leader_nodes` nodes."""
        if self.preemption == "leads":
            return leader_nodes
        if self.sweep_nodes is not None:
            return self.sweep_nodes(run, profile, leader_nodes)
        own = profile.resources(self.resource_key).nodes
        base = profile.resources(leader().resource_key).nodes
        return max(1, math.ceil(leader_nodes * own / base))


_KINDS: dict[str, ComponentKind] = {}


def register_component(kind: ComponentKind) -> ComponentKind:
    """Add a kind (after the ones already registered: het-group order is registration order).
    Registering the very same kind again (a module imported twice) is a no-op; another kind under
    a taken name, a second leader or a bad name is an error."""
    if not NAME.match(kind.name):
        raise ValueError(f"component name {kind.name!r}: lower-case letters, digits and _ only, "
                         "starting with a letter (it names files, log folders and variables)")
    old = _KINDS.get(kind.name)
    if old is not None:
        if old == kind or (old.launcher, old.serves, old.preemption) == (kind.launcher, kind.serves, kind.preemption):
            return old
        raise ValueError(f"component '{kind.name}' is already registered (launcher {old.launcher})")
    if kind.preemption == "leads" and any(k.preemption == "leads" for k in _KINDS.values()):
        raise ValueError(f"component '{kind.name}': preemption 'leads' is taken by '{leader().name}' "
                         "(one component leads the stop)")
    _KINDS[kind.name] = kind
    return kind


def unregister_component(name: str) -> None:
    """Remove a kind (tests that register a toy one)."""
    _KINDS.pop(name, None)


def component_kind(name: str) -> ComponentKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"no component kind '{name}'; registered: {', '.join(_KINDS)} (a plugin module "
                       "listed under plugins: may register more)") from None


def component_kinds() -> list[ComponentKind]:
    """Every registered kind, in registration (het-group) order."""
    return list(_KINDS.values())


def component_names() -> tuple[str, ...]:
    return tuple(_KINDS)


def leader() -> ComponentKind:
    """The kind whose ranks lead a stop for preemption (the actor)."""
    return next(k for k in _KINDS.values() if k.preemption == "leads")


def declared_components(run: RunConfig) -> tuple[str, ...]:
    """The components `run` needs, in het-group order."""
    return tuple(k.name for k in _KINDS.values() if k.declared_by(run))


def serving_components(components: list[str] | tuple[str, ...]) -> list[str]:
    """Those of `components` that publish an address (unknown names: none)."""
    return [c for c in components if c in _KINDS and _KINDS[c].serves]


def rollout_job(run: RunConfig) -> bool:
    """A rollout algorithm's training job (not a trainer's, not `eval`/`generate`): the only jobs
    with components beside the actor."""
    return run.spec.rollout and not run.eval.standalone


def _critic_nodes(run: RunConfig, profile: ClusterProfile, leader_nodes: int) -> int:
    from slurm_align.slurm.sweep import critic_nodes_for  # the sweep imports the run config
    return critic_nodes_for(leader_nodes, run.sweep.actor_to_critic_nodes)


ACTOR = register_component(ComponentKind(
    "actor", "slurm_align.launchers.actor", declared_by=lambda run: True, parallel_field="actor",
    preemption="leads"))
CRITIC = register_component(ComponentKind(
    "critic", "slurm_align.launchers.critic",
    declared_by=lambda run: rollout_job(run) and (run.spec.value_model or run.reward.use_model),
    parallel_field="critic", serves=True, preemption="survives", sweep_nodes=_critic_nodes,
    lost_peer=r"CriticError: critic at \S+, endpoint \w+: |CriticUnavailableError"))
GENERATOR = register_component(ComponentKind(
    "generator", "slurm_align.launchers.generator",
    declared_by=lambda run: rollout_job(run) and run.rollout.mode == "disaggregated",
    parallel_field="generator", serves=True, preemption="follows", lost_peer=r"StreamClosed: the peer closed"))
TEACHER = register_component(ComponentKind(
    "teacher", "slurm_align.launchers.teacher",
    declared_by=lambda run: rollout_job(run) and run.teacher_model is not None and not run.switches.colocated_teacher,
    parallel_field="teacher", serves=True, preemption="survives",
    lost_peer=r"CriticError: teacher at \S+, endpoint \w+: |CriticUnavailableError"))
