"""The environment of the private Ray instance TensorRT-LLM's workers run in, inside a Slurm step.

Ray's daemons and TensorRT-LLM's Ray workers copy the environment of the process that starts
them (the replica's requester rank), so it is set here, for the duration of the start-up only:
- only the replica's GPUs visible (CUDA_VISIBLE_DEVICES), checked first: integer ordinals
  (TensorRT-LLM's workers parse them as integers: UUID and MIG forms crash them), unique (one
  GPU per TP rank: `0,0` comes from identical per-task values), exactly TP of them;
- none of the job's launcher variables (LAUNCHER_PREFIXES: a worker importing tensorrt_llm
  would otherwise try to join the job's PMIx/MPI world, "pmix mismatch"), nor our rendezvous
  (MASTER_ADDR/PORT: TensorRT-LLM's workers set their own);
- TensorRT-LLM's switches for a restricted cpuset and colocated refits (TRTLLM_ENV).
ray.init gets num_cpus: this task's cpuset (os.sched_getaffinity; Ray starts a worker per CPU it
is given, so not the node's count), but at least what TensorRT-LLM's Ray executor asks for
(trtllm_ray_cpus: a placement group of TP CPUs and its two response-queue actors; Ray's CPUs are
a scheduling count, and a request above the instance's count waits forever: start-up hangs). It
gets a temp dir of its own (never the node's shared /tmp/ray) and log_to_driver on: the workers'
output lands in this rank's log, which the launcher writes into the run's logs.

Several private instances on one node (one per generation replica): every port ray.init chooses
is a free one, except the dashboard agent's HTTP port (52365 in every Ray 2.x; ray.init cannot
set it): the second instance's agent runs without its HTTP server, which nothing here uses
(measured with Ray 2.60: two instances on one node, both run tasks; the second reports port -1).
Ray variables of the job's environment that would pin a port or join another instance
(RAY_PINS) are kept out of the instance's environment, or two instances would collide.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from slurm_align.generation.params import GenerationError

# PMI/PMIx (Slurm's and PRRTE's), OpenMPI (OMPI/ORTE/OPAL/PRTE), Intel MPI and MPICH (I_MPI,
# HYDRA, MPICH, PMI_), Slurm's own (SLURM_, SLURMD_, SRUN_, SBATCH_), torch's rendezvous.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "PRTE_", "OMPI_", "ORTE_", "OPAL_", "MPI_", "I_MPI_", "HYDRA_", "MPICH_",
                     "SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "MASTER_ADDR", "MASTER_PORT")
# Ray variables that make a new head take a fixed GCS port, or a driver join another instance.
RAY_PINS = ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT")
# TensorRT-LLM 1.2's Ray executor (tensorrt_llm/executor/ray_executor.py, result.py): its default
# placement group has a bundle of min(TP, GPUs of the node) GPUs and as many CPUs, and its
# response queues are actors of num_cpus=2 each (RayAsyncQueue, RaySyncQueue).
TRTLLM_QUEUE_CPUS = 2 + 2
TRTLLM_ENV = {
    # its NUMA-aware worker affinity fails under a restricted cpuset ("CPU number 0 is not eligible")
    "TLLM_NUMA_AWARE_WORKER_AFFINITY": "0",
    # load (refit) weights in one thread: the colocated IPC path, as veRL runs it
    "TRT_LLM_DISABLE_LOAD_WEIGHTS_IN_PARALLEL": "1",
}


def parse_visible_devices(value: str | None, count: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES as the ordinals this process sees, or all `count` devices when unset;
    UUID / MIG forms refused (TensorRT-LLM's workers parse integers)."""
    if value is None:
        return [str(i) for i in range(count)]
    entries = [e.strip() for e in value.split(",") if e.strip()]
    odd = [e for e in entries if not e.isdigit()]
    if odd:
        raise GenerationError(
            f"CUDA_VISIBLE_DEVICES={value!r}: entries {odd} are not GPU ordinals (UUID or MIG forms); "
            "TensorRT-LLM's Ray workers parse CUDA_VISIBLE_DEVICES as integers. Give the GPUs by index "
            "(e.g. Slurm's --gpu-bind=map_gpu or no per-task binding), or use generation.engine 'torch'")
    return entries


def check_replica_gpus(gpus: list[str], tp_size: int) -> list[str]:
    """The GPUs of one generation replica, one per TP rank: unique, integer, exactly tp_size."""
    odd = [g for g in gpus if not str(g).isdigit()]
    if odd:
        raise GenerationError(f"generation replica GPUs {gpus}: {odd} are not GPU ordinals (UUID or MIG forms are "
                              "not accepted by TensorRT-LLM's Ray workers); give CUDA_VISIBLE_DEVICES by index")
    if len(set(gpus)) != len(gpus):
        raise GenerationError(
            f"generation replica GPUs {gpus}: the TP ranks of one TensorRT-LLM replica must be on different GPUs "
            "(the same value in every task's CUDA_VISIBLE_DEVICES gives this); run one rank per GPU")
    if len(gpus) != tp_size:
        raise GenerationError(f"generation replica GPUs {gpus}: {len(gpus)} GPU(s) for tensor_parallel={tp_size}; "
                              "TensorRT-LLM needs exactly one GPU per TP rank, all on one node")
    return list(gpus)


def task_cpus() -> int:
    """CPUs this task may run on (its cpuset under Slurm), not the node's count."""
    return len(os.sched_getaffinity(0))


def trtllm_ray_cpus(tp_size: int) -> int:
    """The CPUs TensorRT-LLM's Ray executor reserves for one LLM of tensor parallel `tp_size`
    (one replica, on one node): its placement group's and its queue actors'."""
    return tp_size + TRTLLM_QUEUE_CPUS


def ray_init_kwargs(num_gpus: int, temp_dir: str | None = None) -> dict:
    """ray.init's arguments for a private instance in this task, for one LLM on `num_gpus` GPUs
    (one per TP rank; see the module docstring)."""
    tmp = temp_dir or tempfile.mkdtemp(prefix="sa-ray-")   # short: Ray's socket paths must fit 107 bytes
    return {"address": "local", "num_cpus": max(task_cpus(), trtllm_ray_cpus(num_gpus)), "num_gpus": num_gpus,
            "include_dashboard": False, "log_to_driver": True, "_temp_dir": tmp}


def worker_env(environ: dict[str, str], gpus: list[str]) -> dict[str, str]:
    """The environment Ray's workers get: launcher variables and Ray's port pins out, the
    replica's GPUs, TRTLLM_ENV."""
    out = {k: v for k, v in environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in RAY_PINS}
    out.update(TRTLLM_ENV)
    out["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return out


@contextmanager
def worker_environ(gpus: list[str]) -> Iterator[None]:
    """os.environ as worker_env gives it, while Ray and the LLM start; restored afterwards, keeping
    variables TensorRT-LLM set for itself inside the block (TLLM_DISABLE_MPI...)."""
    saved = dict(os.environ)
    inside = worker_env(saved, gpus)
    os.environ.clear()
    os.environ.update(inside)
    try:
        yield
    finally:
        added = {k: v for k, v in os.environ.items() if k not in inside}
        os.environ.clear()
        os.environ.update(saved)
        os.environ.update(added)
