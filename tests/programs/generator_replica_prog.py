"""The generator component's replicas on real MPI ranks (run under mpirun -n 4; not a test).

1. replica_layout(world, 2): ranks {0, 1} and {2, 3} form replicas 0 and 1, the first rank of
   each the requester, mp_comm spanning exactly its pair.
2. A TensorRT-LLM run with generator.tensor_parallel 2: the Generator gives its engine that
   layout (one LLM per pair; TensorRT-LLM itself is only imported at the first refit, on a GPU).
3. The real collector with the torch engine over TP 2 replicas through the work-stealing prompt
   server: every sample of the step comes back exactly once, from requesters only.
Any failure raises, so mpirun exits non-zero; rank 0 prints GENERATOR_REPLICAS_OK and a JSON line.
"""

from __future__ import annotations

import gc

gc.disable()   # this rank's imports without the collector: slurm_align.launchers.importing says why

import json
from collections import Counter
from types import SimpleNamespace

import torch
from mpi4py import MPI

from slurm_align import REPO_ROOT
from slurm_align.algorithms.generator import Generator, replica_layout
from slurm_align.config import load_run_config
from slurm_align.generation.trtllm_engine import TrtllmEngine
from slurm_align.generation.weights import expected_shapes

gc.freeze()   # what the imports made, out of every later collection's walk
gc.enable()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
EXAMPLE = REPO_ROOT / "examples" / "grpo_async_tiny.yaml"
QWEN_STYLE = ["model.position_embedding=rope", "model.normalization=RMSNorm", "model.activation=swiglu",
              "model.add_bias_linear=false"]
env = SimpleNamespace(comm=comm, rank=rank)

# 1. the layout
layout = replica_layout(comm, 2)
if (layout.dp_rank, layout.dp_size, layout.tp_rank, layout.tp_size) != (rank // 2, size // 2, rank % 2, 2):
    raise AssertionError(f"rank {rank}: layout {layout}")
if layout.is_requester != (rank % 2 == 0) or layout.mp_comm.allgather(rank) != [rank - rank % 2, rank - rank % 2 + 1]:
    raise AssertionError(f"rank {rank}: requester {layout.is_requester}, replica {layout.mp_comm.allgather(rank)}")

# 2. TensorRT-LLM's engine gets the replica
trt_run = load_run_config(EXAMPLE, [*QWEN_STYLE, "generation.engine=trtllm", "generator.tensor_parallel=2",
                                    f"generator.data_parallel={size // 2}"])
gen = Generator(trt_run, None, SimpleNamespace(**vars(env), device=f"cuda:{rank % 2}"))
engine = gen.engine
if not isinstance(engine, TrtllmEngine) or engine.tp_size != 2 or engine.is_requester != layout.is_requester:
    raise AssertionError(f"rank {rank}: engine {type(engine).__name__} tp {getattr(engine, 'tp_size', None)}")
if engine.comm.allgather(rank) != layout.mp_comm.allgather(rank) or engine.device != torch.device(f"cuda:{rank % 2}"):
    raise AssertionError(f"rank {rank}: the engine's replica or device is not the generator's")

# 3. the collector over TP 2 replicas (torch engine: each pair generates in lock-step)
run = load_run_config(EXAMPLE, [f"generator.data_parallel={size}", "ppo.num_rollout_samples=12",
                                "rl.n_samples_per_prompt=2", "generation.prompt_batch_size=2",
                                "ppo.global_batch_size=null"])
gen = Generator(run, None, SimpleNamespace(**vars(env), device="cpu"))
g = torch.Generator().manual_seed(0)
gen.engine.refit({k: torch.randn(s, generator=g) * 0.1 for k, s in expected_shapes(gen.shape).items()})
got = gen.collector.collect(1, comm, layout).batch
if not layout.is_requester and got.size:
    raise AssertionError(f"rank {rank}: a follower kept {got.size} samples")
every = comm.gather(got["index"].tolist() if got.size else [], root=0)
if rank == 0:
    counts = Counter(i for part in every for i in part)
    want = Counter(range(run.rollouts_per_step))
    if counts != want:
        raise AssertionError(f"samples: missing {dict(want - counts)}, repeated {dict(counts - want)}")
    print(json.dumps({"per_rank": [len(p) for p in every]}), flush=True)
    print("GENERATOR_REPLICAS_OK", flush=True)
