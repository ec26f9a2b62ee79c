"""Hardware figures for the step-time plan: a profile's `hardware` section over documented defaults.

Defaults per rank (one GPU; on CPU one core), dense matmul peaks (no sparsity), from the vendors'
data sheets (SXM parts):

    accelerator  bf16/fp16 TFLOP/s  fp32 TFLOP/s  memory GB/s  memory GiB  intra-node GB/s  inter-node GB/s
    H100         989                67            3350         80          450 (NVLink 4)   50 (400 Gb/s NIC per GPU)
    H200         989                67            4800         141         450 (NVLink 4)   50
    A100         312                19.5          2039         80          300 (NVLink 3)   25 (200 Gb/s NIC per GPU)
    cpu          0.017              0.017         10           8           5 (shared mem)   2 (loopback TCP)

and the latency of one collective (an all-reduce of a few bytes), intra-node / inter-node: the
GPUs 10 / 25 us, the order of NCCL's small-message all-reduce (its LL protocol) on NVLink and on
InfiniBand, not a measurement of this project's (put your cluster's in the profile); cpu 1800 /
1800 us, measured on a machine of this project's kind (2-core AMD EPYC VM with AVX-512,
`measure_collective_latency()`: torch's gloo all-reduce of 64 bytes between two processes of the
host, 1.7-2.0 ms; 4 MiB took 4.2 ms, so the 2 GB/s above holds for gloo too).

The CPU row's peak is from another machine of this kind (2-core Xeon, no AVX-512, shared): 0.017
TFLOP/s = 17 GFLOP/s is what `measure_cpu_flops()` measured for one core (a 512 x 512 fp32 matmul
in torch with one thread, 20 repeats after 3 warm-ups: 2 * 512^3 * 20 / seconds). Torch runs bf16
matmuls on such a CPU no faster than fp32, so both get the same figure. Its bandwidths are rough
guesses for shared-memory MPI and loopback TCP; a calibration (planning/calibration.py) absorbs
what they get wrong, for the phases it has spans of. Rerun `measure_cpu_flops()` on another
machine and put the figure in the profile (`hardware: {peak_tflops: {fp32: ...}}`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from slurm_align.config.profile import ClusterProfile, HardwareConfig

_DEFAULTS: dict[str, dict] = {
    "H100": {"peak_tflops": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, "memory_bandwidth_gbs": 3350.0,
             "memory_gib": 80.0, "intra_node_gbs": 450.0, "inter_node_gbs": 50.0, "intra_node_latency_us": 10.0,
             "inter_node_latency_us": 25.0},
    "H200": {"peak_tflops": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}, "memory_bandwidth_gbs": 4800.0,
             "memory_gib": 141.0, "intra_node_gbs": 450.0, "inter_node_gbs": 50.0, "intra_node_latency_us": 10.0,
             "inter_node_latency_us": 25.0},
    "A100": {"peak_tflops": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, "memory_bandwidth_gbs": 2039.0,
             "memory_gib": 80.0, "intra_node_gbs": 300.0, "inter_node_gbs": 25.0, "intra_node_latency_us": 10.0,
             "inter_node_latency_us": 25.0},
    "cpu": {"peak_tflops": {"bf16": 0.017, "fp16": 0.017, "fp32": 0.017}, "memory_bandwidth_gbs": 10.0,
            "memory_gib": 8.0, "intra_node_gbs": 5.0, "inter_node_gbs": 2.0, "intra_node_latency_us": 1800.0,
            "inter_node_latency_us": 1800.0},
}
"""Per-rank defaults by accelerator (see the module docstring for their sources)."""


@dataclass(frozen=True)
class Hardware:
    """Resolved figures of one rank, in SI units (FLOP/s, bytes/s, bytes)."""

    accelerator: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    host_cores: int | None
    """Cores of the one host every node of the profile runs on (HardwareConfig.shared_host), else None."""
    intra_node_latency: float = 0.0
    """Seconds of one collective between ranks of one node, whatever its bytes."""
    inter_node_latency: float = 0.0
    """Seconds of one collective between ranks of different nodes, whatever its bytes."""

    def flops(self, dtype: str) -> float:
        return self.peak_flops[dtype]


def resolve(hw: HardwareConfig, *, cpus_per_task: int = 1, memory_gib: float | None = None) -> Hardware:
    """The profile's figures over the accelerator's defaults. On CPU a rank's peak, memory and
    memory bandwidth scale with its cores (cpus_per_task). `memory_gib`: the profile's
    gpu_memory_gib (the memory plan's limit too), else the accelerator's default."""
    d = _DEFAULTS[hw.accelerator]
    per_core = cpus_per_task if hw.accelerator == "cpu" else 1
    given: dict[str, float] = {str(k): v for k, v in hw.peak_tflops.items()}
    peaks = {k: (given.get(k) or v * per_core) * 1e12 for k, v in d["peak_tflops"].items()}
    return Hardware(
        accelerator=hw.accelerator, peak_flops=peaks,
        memory_bandwidth=(hw.memory_bandwidth_gbs or d["memory_bandwidth_gbs"] * per_core) * 1e9,
        memory_bytes=(memory_gib or d["memory_gib"] * per_core) * 2**30,
        intra_node_bandwidth=(hw.intra_node_gbs or d["intra_node_gbs"]) * 1e9,
        inter_node_bandwidth=(hw.inter_node_gbs or d["inter_node_gbs"]) * 1e9,
        host_cores=(os.cpu_count() or 1) if hw.shared_host else None,
        intra_node_latency=_given(hw.intra_node_latency_us, d["intra_node_latency_us"]) * 1e-6,
        inter_node_latency=_given(hw.inter_node_latency_us, d["inter_node_latency_us"]) * 1e-6)


def _given(value: float | None, default: float) -> float:
    """The profile's figure where it gives one (0 included), else the default."""
    return default if value is None else value


def profile_hardware(profile: ClusterProfile, component: str) -> Hardware:
    """One component's rank figures (its cpus_per_task matter on CPU)."""
    return resolve(profile.hardware, cpus_per_task=profile.resources(component).cpus_per_task,
                   memory_gib=profile.gpu_memory_gib)


def measure_cpu_flops(n: int = 512, repeats: int = 20) -> float:
    """This CPU's fp32 matmul rate on ONE core, FLOP/s: an n x n matmul in torch with one thread,
    `repeats` times after 3 warm-ups (2 n^3 FLOPs each). The CPU row of the defaults came from it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        for _ in range(3):
            a @ b
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        return 2 * n**3 * repeats / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def measure_collective_latency(repeats: int = 200) -> float:
    """Seconds of one all-reduce of 64 bytes between two processes of this host over torch's
    gloo (the CPU row's latency came from it), after 20 warm-ups."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_allreduce_latency, args=(f"{tmp}/store", repeats, out), nprocs=2)
        return out.get()


def _allreduce_latency(rank: int, store: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        x = torch.zeros(16)
        for _ in range(20):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        if rank == 0:
            out.put((time.perf_counter() - t0) / repeats)
    finally:
        dist.destroy_process_group()
