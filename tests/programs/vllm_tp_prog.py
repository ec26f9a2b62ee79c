"""vLLM replicas of TP 2 on real MPI ranks (mpirun -n 2: one replica; -n 4: two, in a world
larger than a replica), each rank its own vLLM worker (external_launcher over the ranks' gloo
world); run by tests/integration/test_generation_vllm.py, not a test.

Reads IN (torch.save'd: the ModelConfig fields, the full state dicts of two models, the prompts of
each replica, seeds); every rank refits with model 1, generates its replica's prompts greedy and
seeded, refits in place with model 2, generates greedy again, and writes what its own engine
returned to OUT/rank<r>.pt, with what vLLM says about its parallel layout. The test compares.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import sys
from pathlib import Path

import torch
from mpi4py import MPI

from slurm_align.algorithms.generator import replica_layout
from slurm_align.config.run import ModelConfig
from slurm_align.generation import GptShape, SamplingParams
from slurm_align.generation.vllm_engine import VllmEngine
from slurm_align.parallel.bootstrap import init_distributed

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

given, out_dir = torch.load(sys.argv[1], weights_only=False), Path(sys.argv[2])
env = init_distributed(MPI.COMM_WORLD, backend="gloo")
layout = replica_layout(env.comm, 2)   # the generator's replicas: consecutive pairs
shape = GptShape.from_model_config(ModelConfig(**given["model"]))
engine = VllmEngine(shape, layout=layout, max_num_seqs=16)
greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
got: dict = {}
try:
    engine.refit(given["weights"][1])
    llm = engine._llm
    from vllm.distributed import parallel_state

    got["parallel"] = {"backend": llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
                       "tp_size": parallel_state.get_tp_group().world_size,
                       "tp_rank": parallel_state.get_tp_group().rank_in_group}
    prompts = given["prompts"][layout.dp_rank]
    got["greedy1"] = engine.generate(prompts, greedy)
    got["sampled1"] = engine.generate(prompts, sampled, seeds=range(len(prompts)))
    engine.refit(given["weights"][2])
    got["same_llm"] = engine._llm is llm   # in place: no second engine
    got["greedy2"] = engine.generate(prompts, greedy)
finally:
    engine.free()
torch.save(got, out_dir / f"rank{env.rank}.pt")
print(f"VLLM_TP_OK rank {env.rank}", flush=True)
