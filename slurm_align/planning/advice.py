"""Advice: for a budget of nodes, the layouts that fit ranked by predicted step time.

Candidates: every split of the budget over the run's components (actor, critic, generator; each
at least one node) and, per component, every TP (a divisor of the node's ranks and of the
key/value heads) and PP (a divisor of the layers) whose product divides its ranks, DP the rest.
The run's batch is kept (strong scaling: the user's batch is the user's). A layout ranks only if
every component's memory plan (config/memory_plan.py: weights, gradients, main weights,
optimizer state by precision and ZeRO, activations by recompute, engine and KV cache) fits its
device memory (`fits`): the profile's gpu_memory_gib, else the accelerator's default.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from slurm_align.config.memory_plan import plan_run
from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import ModelConfig, ParallelConfig, RunConfig
from slurm_align.planning.hardware import profile_hardware
from slurm_align.planning.steptime import Costs, StepPrediction, Workload, predict


@dataclass
class LayoutOption:
    run: RunConfig
    profile: ClusterProfile
    prediction: StepPrediction
    state_bytes: dict[str, float]
    """The memory plan's total per GPU of each component (bytes)."""


def fits(run: RunConfig, profile: ClusterProfile) -> tuple[bool, dict[str, float]]:
    """Whether each component's memory plan fits its device memory, and the plans' totals (bytes)."""
    need = {c.name: float(c.total) for c in plan_run(run)}
    ok = all(b <= profile_hardware(profile, comp).memory_bytes for comp, b in need.items())
    return ok, need


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(m: ModelConfig, ranks: int, per_node: int) -> list[ParallelConfig]:
    out = []
    for tp in _divisors(per_node):
        if m.query_groups % tp:
            continue
        for pp in _divisors(m.num_layers):
            if ranks % (tp * pp) == 0:
                out.append(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp, data_parallel=ranks // (tp * pp)))
    return out


def _component_need(run: RunConfig, comp: str) -> float | None:
    """The memory plan's total per GPU of one component (None: the plan has no such component,
    e.g. the generator's engine replicas). It depends on that component's layout only."""
    return next((float(c.total) for c in plan_run(run) if c.name == comp), None)


def _options(run: RunConfig, profile: ClusterProfile, budget: int,
             prune: bool) -> Iterator[tuple[ClusterProfile, list[list[tuple[ParallelConfig, float | None]]]]]:
    """Per split of `budget` nodes over the run's components (each at least one node): the profile
    with those node counts and, per component, its layouts with their memory need. With `prune`,
    a component layout that does not fit its device memory is dropped here, before any layout
    containing it is built or costed; the order of the rest is kept."""
    comps = list(run.components)
    need: dict[tuple[str, str], float | None] = {}   # a component's need per layout
    for split in itertools.product(range(1, budget + 1), repeat=len(comps)):
        if sum(split) != budget:
            continue
        resources = dict(profile.components)
        options: list[list[tuple[ParallelConfig, float | None]]] = []
        for comp, nodes in zip(comps, split):
            res = resources[comp].model_copy(update={"nodes": nodes})
            resources[comp] = res
            model = run.critic_model_config if comp == "critic" else run.model
            if comp == "generator":   # the engine replicas: TP 1 unless TensorRT-LLM, no PP
                layouts = [ParallelConfig(data_parallel=res.ranks)]
            else:
                layouts = _layouts(model, res.ranks, res.tasks_per_node)
            new_profile = profile.model_copy(update={"components": resources})
            cap = profile_hardware(new_profile, comp).memory_bytes
            kept = []
            for par in layouts:
                key = (comp, par.model_dump_json())
                if key not in need:
                    need[key] = _component_need(run.model_copy(update={comp: par}), comp)
                got = need[key]
                if not prune or got is None or got <= cap:
                    kept.append((par, got))
            options.append(kept)
        yield profile.model_copy(update={"components": resources}), options


def candidates(run: RunConfig, profile: ClusterProfile, budget: int) -> list[tuple[RunConfig, ClusterProfile]]:
    """Every split of `budget` nodes over the run's components and every TP/PP/DP per component."""
    comps = list(run.components)
    out = []
    for new_profile, options in _options(run, profile, budget, prune=False):
        for layout in itertools.product(*options):
            out.append((run.model_copy(update={c: par for c, (par, _) in zip(comps, layout)}), new_profile))
    return out


def rank_layouts(run: RunConfig, profile: ClusterProfile, budget: int, *, costs: Costs | None = None,
                 work: Workload | None = None, dtype: str = "fp32", top: int = 5) -> list[LayoutOption]:
    """The `top` fastest layouts of `budget` nodes that fit in memory, fastest first (ties in the
    order of `candidates`). Each component layout's memory plan is computed once and one that
    does not fit is pruned before the layouts containing it are costed; what a layout's
    prediction shares with others (the engine batches' generation) is cached in steptime."""
    comps = list(run.components)
    ranked = []
    for new_profile, options in _options(run, profile, budget, prune=True):
        for layout in itertools.product(*options):
            cand = run.model_copy(update={c: par for c, (par, _) in zip(comps, layout)})
            need = {c: b for c, (_, b) in zip(comps, layout) if b is not None}
            ranked.append(LayoutOption(cand, new_profile, predict(cand, new_profile, costs=costs, work=work,
                                                                  dtype=dtype), need))
    ranked.sort(key=lambda o: o.prediction.step_s)
    return ranked[:top]
