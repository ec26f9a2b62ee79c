"""Advice: for a budget of nodes, the layouts that fit ranked by predicted step time.

Candidates: every split of the budget over the run's components (actor, critic, generator; each
at least one node) and, per component, every TP (a divisor of the node's ranks and of the
key/value heads) and PP (a divisor of the layers) whose product divides its ranks, DP the rest.
The run's batch is kept (strong scaling: the user's batch is the user's). A layout ranks only if
every rank's training state fits its device memory (`fits`); the check is the simple one,
weights + fp32 gradients + Adam's two fp32 moments, (4 + 4 + 8) bytes per parameter on the
rank's TP x PP share (the memory plan of `slurm-align plan` replaces it at merge).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from slurm_align.config.profile import ClusterProfile
from slurm_align.config.run import ModelConfig, ParallelConfig, RunConfig
from slurm_align.planning.hardware import profile_hardware
from slurm_align.planning.steptime import DTYPE_BYTES, GRAD_BYTES, Costs, ModelShape, StepPrediction, Workload, predict

ADAM_BYTES = 8
"""Adam's exp_avg and exp_avg_sq, fp32."""


@dataclass
class LayoutOption:
    run: RunConfig
    profile: ClusterProfile
    prediction: StepPrediction
    state_bytes: dict[str, float]
    """Training state per rank of each component that trains (bytes)."""


def state_bytes_per_rank(m: ModelConfig, par: ParallelConfig, dtype: str, *, value_head: bool = False) -> float:
    """Weights, fp32 gradients and Adam state of one rank's TP x PP share of the model."""
    params = ModelShape.of(m, value_head=value_head).params / (par.tensor_parallel * par.pipeline_parallel)
    return params * (DTYPE_BYTES[dtype] + GRAD_BYTES + ADAM_BYTES)


def fits(run: RunConfig, profile: ClusterProfile, dtype: str = "fp32") -> tuple[bool, dict[str, float]]:
    """Whether each training component's per-rank state fits its device memory, and the states."""
    need = {"actor": state_bytes_per_rank(run.model, run.actor, dtype)}
    if "critic" in run.components:
        need["critic"] = state_bytes_per_rank(run.critic_model_config, run.critic, dtype, value_head=True)
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


def candidates(run: RunConfig, profile: ClusterProfile, budget: int) -> list[tuple[RunConfig, ClusterProfile]]:
    """Every split of `budget` nodes over the run's components and every TP/PP/DP per component."""
    comps = list(run.components)
    out = []
    for split in itertools.product(range(1, budget + 1), repeat=len(comps)):
        if sum(split) != budget:
            continue
        resources = dict(profile.components)
        options: list[list[ParallelConfig]] = []
        for comp, nodes in zip(comps, split):
            res = resources[comp].model_copy(update={"nodes": nodes})
            resources[comp] = res
            model = run.critic_model_config if comp == "critic" else run.model
            if comp == "generator":   # the engine replicas: TP 1 unless TensorRT-LLM, no PP
                options.append([ParallelConfig(data_parallel=res.ranks)])
            else:
                options.append(_layouts(model, res.ranks, res.tasks_per_node))
        new_profile = profile.model_copy(update={"components": resources})
        for layout in itertools.product(*options):
            out.append((run.model_copy(update=dict(zip(comps, layout))), new_profile))
    return out


def rank_layouts(run: RunConfig, profile: ClusterProfile, budget: int, *, costs: Costs | None = None,
                 work: Workload | None = None, dtype: str = "fp32", top: int = 5) -> list[LayoutOption]:
    """The `top` fastest layouts of `budget` nodes that fit in memory, fastest first."""
    ranked = []
    for cand_run, cand_profile in candidates(run, profile, budget):
        ok, need = fits(cand_run, cand_profile, dtype)
        if not ok:
            continue
        ranked.append(LayoutOption(cand_run, cand_profile, predict(cand_run, cand_profile, costs=costs, work=work,
                                                                   dtype=dtype), need))
    ranked.sort(key=lambda o: o.prediction.step_s)
    return ranked[:top]
