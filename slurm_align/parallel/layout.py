"""TP/PP/DP(/EP) layout on megatron-core's parallel_state, and the PP->DP refold for generation.

Expert parallelism (MoE models) splits each layer's experts over EP of the DP ranks
(consecutive data-parallel ranks: megatron's expert grid with expert-TP = TP = 1); the dense
weights stay data-parallel over all DP ranks, the experts over DP / EP ranks (`edp_group`).

Global rank order is megatron's default: rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank).
megatron's GPTModel reads parallel_state's module globals, so we initialise them, but everything
in slurm_align reads the layout from the ParallelContext object that is passed around.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

from slurm_align.config.errors import ConfigError
from slurm_align.parallel.bootstrap import DistEnv


class LayoutNotInitialised(RuntimeError):
    """A ParallelContext was used before initialize_model_parallel or after destroy()."""


@dataclass(frozen=True)
class GenerationLayout:
    """Where this rank sits while generating.

    refold on: DP_gen = DP*PP, dp_rank = dp + DP*pp, TP unchanged, PP 1 (every PP stage holds
    the full model for generation). refold off: the training layout (generation runs through
    the PP stages). `mp_comm`/`mp_group` span one generation model replica (TP, or TP x PP
    without refold); `is_requester` marks its one rank that talks to the prompt server.
    """

    refold: bool
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_group: Any  # torch process group over generation-DP peers (same tp rank)
    tp_group: Any  # torch process group over the generation TP group
    dp_comm: Any  # mpi4py communicator, same members as dp_group
    mp_comm: Any  # mpi4py communicator over one generation replica; rank 0 = requester
    is_requester: bool


@dataclass(frozen=True)
class _Ranks:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    ep_rank: int = 0
    ep_size: int = 1


def expected_ranks(rank: int, tp: int, pp: int, world: int) -> _Ranks:
    """Megatron's default order, as a formula (the tests check megatron against it)."""
    dp = world // (tp * pp)
    return _Ranks(rank % tp, tp, rank // (tp * dp), pp, (rank // tp) % dp, dp)


def validate_layout(world_size: int, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1) -> int:
    """Data-parallel size for this layout, or ConfigError naming the fields."""
    for name, v in (("parallel.tensor_parallel", tensor_parallel), ("parallel.pipeline_parallel", pipeline_parallel),
                    ("parallel.expert_parallel", expert_parallel)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError.at(name, v, "must be an integer >= 1")
    mp = tensor_parallel * pipeline_parallel
    if world_size % mp:
        raise ConfigError.at(
            "parallel.tensor_parallel*pipeline_parallel",
            mp,
            f"must divide the component's world size {world_size} "
            f"(tp={tensor_parallel}, pp={pipeline_parallel})",
        )
    dp = world_size // mp
    if dp % expert_parallel or (expert_parallel > 1 and tensor_parallel > 1):
        raise ConfigError.at("parallel.expert_parallel", expert_parallel,
                             f"must divide the data-parallel size {dp}, with tensor_parallel=1 "
                             f"(tp={tensor_parallel}, pp={pipeline_parallel}, world {world_size})")
    return dp


class ParallelContext:
    """The TP/PP/DP layout of this rank. Getters raise once destroy() has run."""

    def __init__(self, env: DistEnv, ranks: _Ranks, groups: dict[str, Any]):
        self._env = env
        self._ranks: _Ranks | None = ranks
        self._groups = groups
        self._gen_cache: dict[bool, GenerationLayout] = {}
        self._mpi_comms: list[Any] = []
        self._torch_groups: list[Any] = []  # groups we made ourselves (megatron frees its own)

    def _r(self) -> _Ranks:
        if self._ranks is None:
            raise LayoutNotInitialised(
                "ParallelContext used after destroy(): call initialize_model_parallel(env, tp, pp) again"
            )
        return self._ranks

    def _g(self, name: str) -> Any:
        self._r()
        return self._groups[name]

    env = property(lambda self: self._env)
    tp_rank = property(lambda self: self._r().tp_rank)
    tp_size = property(lambda self: self._r().tp_size)
    pp_rank = property(lambda self: self._r().pp_rank)
    pp_size = property(lambda self: self._r().pp_size)
    dp_rank = property(lambda self: self._r().dp_rank)
    dp_size = property(lambda self: self._r().dp_size)
    ep_rank = property(lambda self: self._r().ep_rank)
    ep_size = property(lambda self: self._r().ep_size)
    ep_group = property(lambda self: self._g("ep"))
    edp_group = property(lambda self: self._g("edp"))  # experts' data-parallel peers (DP / EP ranks)
    tp_group = property(lambda self: self._g("tp"))
    pp_group = property(lambda self: self._g("pp"))
    dp_group = property(lambda self: self._g("dp"))
    mp_group = property(lambda self: self._g("mp"))
    is_first_stage = property(lambda self: self._r().pp_rank == 0)
    is_last_stage = property(lambda self: self._r().pp_rank == self._r().pp_size - 1)

    @property
    def dp_comm(self) -> Any:
        """mpi4py communicator over this rank's training-DP peers (for rebalance)."""
        return self._mpi_split("dp_comm", self.tp_rank + self.tp_size * self.pp_rank, self.dp_rank)

    def _mpi_split(self, key: str, color: int, order: int) -> Any:
        # Collective the first time it is asked for on every rank; cached after.
        if key not in self._groups:
            comm = self._env.comm.Split(color, order)
            self._mpi_comms.append(comm)
            self._groups[key] = comm
        return self._g(key)

    @contextlib.contextmanager
    def generation_layout(self, refold: bool) -> Iterator[GenerationLayout]:
        """The layout to generate in. Build generation data loaders / prompt sources INSIDE it.

        Entering it is collective (all ranks, same `refold`) the first time for each value of
        `refold`: it creates the generation process groups and MPI communicators, then caches them.
        """
        self._r()
        if refold not in self._gen_cache:
            self._gen_cache[refold] = self._build_generation_layout(refold)
        yield self._gen_cache[refold]
        self._r()  # a destroy() inside the block is a bug in the caller

    def _build_generation_layout(self, refold: bool) -> GenerationLayout:
        r = self._r()
        comm = self._env.comm
        if refold:
            dp_rank, dp_size, pp_rank, pp_size = r.dp_rank + r.dp_size * r.pp_rank, r.dp_size * r.pp_size, 0, 1
            # Generation DP peers: every rank with the same tp_rank (all dp and pp positions).
            world = self._env.world_size
            dp_group = None
            for t in range(r.tp_size):  # new_group is collective: every rank builds every group
                g = dist.new_group(list(range(t, world, r.tp_size)))
                self._torch_groups.append(g)
                if t == r.tp_rank:
                    dp_group = g
            tp_group, mp_color = self._groups["tp"], self._env.rank // r.tp_size
            mp_order = r.tp_rank
        else:
            dp_rank, dp_size, pp_rank, pp_size = r.dp_rank, r.dp_size, r.pp_rank, r.pp_size
            dp_group, tp_group = self._groups["dp"], self._groups["tp"]
            mp_color, mp_order = r.dp_rank, r.tp_rank + r.tp_size * r.pp_rank
        dp_comm = comm.Split(r.tp_rank + (0 if refold else r.tp_size * r.pp_rank), dp_rank)
        mp_comm = comm.Split(mp_color, mp_order)
        self._mpi_comms += [dp_comm, mp_comm]
        return GenerationLayout(
            refold=refold,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_rank=r.tp_rank,
            tp_size=r.tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dp_group=dp_group,
            tp_group=tp_group,
            dp_comm=dp_comm,
            mp_comm=mp_comm,
            is_requester=mp_comm.Get_rank() == 0,
        )

    def destroy(self) -> None:
        """Release megatron's parallel state and our communicators (collective)."""
        if self._ranks is None:
            return
        for c in self._mpi_comms:
            c.Free()
        self._mpi_comms.clear()
        for g in self._torch_groups:
            dist.destroy_process_group(g)
        self._torch_groups.clear()
        self._gen_cache.clear()
        self._groups.clear()
        self._ranks = None
        parallel_state.destroy_model_parallel()


def initialize_model_parallel(env: DistEnv, tensor_parallel: int, pipeline_parallel: int,
                              expert_parallel: int = 1) -> ParallelContext:
    """Initialise megatron-core's parallel state (collective) and return the layout object."""
    validate_layout(env.world_size, tensor_parallel, pipeline_parallel, expert_parallel)
    if not dist.is_initialized():
        raise LayoutNotInitialised("torch.distributed is not initialised: call init_distributed() first")
    if parallel_state.model_parallel_is_initialized():
        raise LayoutNotInitialised(
            "megatron parallel state is already initialised: destroy() the old ParallelContext first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
    )
    ranks = _Ranks(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    r = expected_ranks(env.rank, tensor_parallel, pipeline_parallel, env.world_size)
    # EP ranks are consecutive DP ranks (expert grid TP=1 x EP x DP/EP x PP)
    want = _Ranks(r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, r.dp_rank, r.dp_size,
                  r.dp_rank % expert_parallel, expert_parallel)
    if ranks != want:
        parallel_state.destroy_model_parallel()
        raise LayoutNotInitialised(f"megatron's rank order {ranks} differs from the assumed order {want}")
    groups = {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "pp": parallel_state.get_pipeline_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(),
        "mp": parallel_state.get_model_parallel_group(),
        "ep": parallel_state.get_expert_model_parallel_group(),
        "edp": parallel_state.get_expert_data_parallel_group(),
    }
    return ParallelContext(env, ranks, groups)
