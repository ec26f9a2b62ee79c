"""Bootstrap errors in one singleton process (no mpirun): each must be a clear BootstrapError.

Prints one line per checked error, then BOOTSTRAP_ERRORS_OK.
"""

from __future__ import annotations

import os
import socket
import sys


def expect(name: str, fn, *needles: str) -> None:
    from slurm_align.parallel.bootstrap import BootstrapError

    try:
        fn()
    except BootstrapError as exc:
        missing = [n for n in needles if n not in str(exc)]
        assert not missing, f"{name}: message lacks {missing}: {exc}"
        print(f"{name}: {exc}", flush=True)
    else:
        raise AssertionError(f"{name}: no BootstrapError")


def main() -> None:
    from slurm_align.parallel.bootstrap import init_distributed

    # No MPI: mpi4py cannot be imported.
    sys.modules["mpi4py"] = None  # type: ignore[assignment]
    expect("no_mpi", init_distributed, "mpi4py")
    del sys.modules["mpi4py"]

    from mpi4py import MPI  # singleton world of size 1

    assert MPI.COMM_WORLD.Get_size() == 1
    # srun without --mpi=pmix: Slurm started 2 tasks, each is a world of its own.
    os.environ.update(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2")
    expect("size_mismatch", init_distributed, "SLURM_STEP_NUM_TASKS=2", "1 rank", "--mpi=pmix")
    del os.environ["SLURM_STEP_ID"], os.environ["SLURM_STEP_NUM_TASKS"]

    expect("nccl_without_gpu", lambda: init_distributed(backend="nccl"), "nccl", "gloo")
    expect("unknown_backend", lambda: init_distributed(backend="mpi"), "allowed")
    os.environ["MASTER_PORT"] = "http"
    expect("bad_port", init_distributed, "MASTER_PORT")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    os.environ["MASTER_PORT"] = str(holder.getsockname()[1])
    expect("port_in_use", init_distributed, "in use", os.environ["MASTER_PORT"])
    del os.environ["MASTER_PORT"]
    holder.close()

    env = init_distributed()  # the singleton itself works (the local profile with one rank)
    assert (env.rank, env.world_size, env.local_rank, env.local_size) == (0, 1, 0, 1), env
    assert env.master_addr == "127.0.0.1" and env.master_port > 0
    expect("twice", init_distributed, "already initialised")
    print("BOOTSTRAP_ERRORS_OK", flush=True)


if __name__ == "__main__":
    main()
