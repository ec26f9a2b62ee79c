"""Program for tests/unit/generation/test_ray_env.py (not a test): one generation replica's private Ray
instance, started as TrtllmEngine starts it (ray_env.ray_init_kwargs inside worker_environ),
from a task whose cpuset holds ONE CPU, asked for what TensorRT-LLM 1.2's Ray executor asks:
a placement group of one bundle with TP GPUs and TP CPUs, and its two response-queue actors of
num_cpus=2 each. Prints RAY_PRIVATE_OK with its GCS address once all are scheduled, holds the
instance for HOLD_S seconds (so that a second instance on this node overlaps it), shuts down.

    python -m tests.programs.ray_private_prog TP HOLD_S [CPU]

CPU: which of this process's CPUs the one-CPU cpuset is (default the first).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    tp, hold = int(sys.argv[1]), float(sys.argv[2])
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[int(sys.argv[3]) % len(cpus)] if len(sys.argv) > 3 else cpus[0]
    import ray
    from ray.util.placement_group import placement_group

    from slurm_align.generation.ray_env import ray_init_kwargs, worker_environ

    os.sched_setaffinity(0, {cpu})   # a Slurm task with one CPU
    with worker_environ([str(i) for i in range(tp)]):
        ray.init(**ray_init_kwargs(tp))
    node = ray._private.worker._global_node   # the instance's addresses, for the report

    @ray.remote(num_cpus=2)
    class Queue:   # TensorRT-LLM's RayAsyncQueue / RaySyncQueue reserve num_cpus=2 each
        def ping(self) -> int:
            return os.getpid()

    pg = placement_group([{"GPU": tp, "CPU": tp}], strategy="PACK")
    queues = [Queue.remote(), Queue.remote()]
    ready = ray.get([pg.ready(), *(q.ping.remote() for q in queues)], timeout=120)
    print(f"RAY_PRIVATE_OK gcs={node.gcs_address} cpus={ray.cluster_resources()['CPU']:g} "
          f"agent_http_port={node.address_info['dashboard_agent_listen_port']} ready={len(ready)}", flush=True)
    time.sleep(hold)
    ray.shutdown()


if __name__ == "__main__":
    main()
