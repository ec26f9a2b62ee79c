"""Rank bootstrap: the MPI world (mpirun, `srun --mpi=pmix`, local profile) -> torch.distributed.

Rank 0 opens the rendezvous socket itself (bound to a specific address, port 0 unless
MASTER_PORT says otherwise) and hands the listening fd to torch's TCPStore, so the port it
broadcasts cannot be taken by someone else in between. Every failure that happens on one rank
is broadcast first, so all ranks fail with the same clear message instead of hanging.

Devices: NCCL when CUDA is there and every rank gets a GPU of its own (local rank -> cuda:
local_rank % visible GPUs, checked by physical device UUID across the node's ranks), gloo on
CPU. Ranks that would share a GPU (2 ranks on a 1-GPU machine) are refused with the fix
(fewer ranks per node, or CUDA_VISIBLE_DEVICES= for a CPU run): NCCL cannot run them.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class BootstrapError(RuntimeError):
    """The job's environment cannot start torch.distributed (MPI, ports, sizes, devices)."""


@dataclass(frozen=True)
class DistEnv:
    """What a rank knows about itself after bootstrap. `comm` is the mpi4py communicator."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node: str
    comm: Any
    backend: str
    device: str
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    _store: Any = field(default=None, repr=False, compare=False)


def _check_slurm_step_has_pmi() -> None:
    """Before MPI_Init: a multi-task srun step without a PMI makes OpenMPI abort obscurely."""
    env = os.environ
    ntasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if "SLURM_STEP_ID" not in env or not ntasks.isdigit() or int(ntasks) < 2:
        return
    if any(k in env for k in ("PMIX_RANK", "PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_SIZE")):
        return
    raise BootstrapError(
        f"this srun step has {ntasks} tasks but no PMI to join them into one MPI world "
        "(no PMIX_RANK/PMI_RANK in the environment): launch with `srun --mpi=pmix` "
        "(pmi2 does not work with this OpenMPI), or set MpiDefault=pmix in slurm.conf"
    )


def _import_mpi():
    if "mpi4py.MPI" not in sys.modules:
        _check_slurm_step_has_pmi()
    try:
        # deferred: importing mpi4py calls MPI_Init (after the PMI check above; the login node never does)
        from mpi4py import MPI
    except ImportError as exc:  # mpi4py missing, or libmpi not loadable
        raise BootstrapError(
            f"cannot import mpi4py ({exc}); install mpi4py against the cluster's MPI "
            "(pip install 'mpi4py>=4.1,<4.2') and make libmpi loadable (module load openmpi?)"
        ) from exc
    return MPI


def _launcher_ntasks() -> tuple[str, int] | None:
    """Task count the launcher claims, to catch `srun` without `--mpi=pmix` (every task alone)."""
    names = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
    # In a het step spanning components the Slurm count is ambiguous: trust MPI there.
    if "SLURM_STEP_ID" in os.environ and "SLURM_HET_SIZE" not in os.environ:
        names.append("SLURM_STEP_NUM_TASKS")
    for var in names:
        value = os.environ.get(var)
        if value and value.isdigit():
            return var, int(value)
    return None


def _check_world_size(size: int, given_comm: bool) -> None:
    if given_comm:  # a sub-communicator is allowed to be smaller than the launch
        return
    claimed = _launcher_ntasks()
    if claimed is not None and claimed[1] != size:
        var, n = claimed
        raise BootstrapError(
            f"the launcher started {n} tasks ({var}={n}) but this process's MPI world has {size} "
            "rank(s): the tasks did not join one MPI world; under Slurm use `srun --mpi=pmix` "
            "(pmi2 does not work with this OpenMPI), or start the ranks with mpirun"
        )


INTERFACE_ENV = "SLURM_ALIGN_NET_IFNAME"
"""The network interface the job's own sockets use (profile `network.interface`), exported by the
job script beside NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME."""


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this host (e.g. 'ib0', 'hsn0')."""
    import psutil  # deferred: only jobs that name an interface need it

    addrs = psutil.net_if_addrs()
    ipv4 = [a.address for a in addrs.get(name, []) if a.family == socket.AF_INET]
    if not ipv4:
        have = {n: [a.address for a in v if a.family == socket.AF_INET] for n, v in addrs.items()}
        listing = ", ".join(f"{n} {','.join(a) or '(no IPv4)'}" for n, a in sorted(have.items()))
        raise BootstrapError(f"network interface {name!r} (profile network.interface, {INTERFACE_ENV}) has no "
                             f"IPv4 address on {socket.gethostname()}; this node has: {listing}")
    return ipv4[0]


def _local_address(multi_node: bool) -> str:
    """An address of this host the other ranks can reach: the profile's network interface when
    one is named, loopback if they all live here, else the first non-loopback address this
    host's name resolves to."""
    if os.environ.get(INTERFACE_ENV):
        return interface_address(os.environ[INTERFACE_ENV])
    if not multi_node:
        return "127.0.0.1"
    host = socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BootstrapError(
            f"cannot resolve this host's name {host!r} to an address ({exc}); set MASTER_ADDR "
            "to an address of rank 0's host that the other nodes can reach"
        ) from exc
    addrs = [str(i[4][0]) for i in infos]   # AF_INET: (host, port); the host is a str already
    routable = [a for a in addrs if not a.startswith("127.")]
    if not routable:
        raise BootstrapError(
            f"host name {host!r} resolves only to loopback {addrs}, which other nodes cannot "
            "reach; set MASTER_ADDR to rank 0's address on the cluster network"
        )
    return routable[0]


def _open_listener(addr: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # SO_REUSEADDR skips TIME_WAIT leftovers but still refuses a port someone listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if port:
            raise BootstrapError(
                f"rendezvous port {addr}:{port} (from MASTER_PORT) is in use or not bindable "
                f"({exc.strerror}); unset MASTER_PORT to let rank 0 pick a free one, or pick "
                "another"
            ) from exc
        raise BootstrapError(f"cannot bind the rendezvous socket on {addr} ({exc}); set MASTER_ADDR") from exc
    return sock


@dataclass(frozen=True)
class Placement:
    """Which GPU a rank would take: cuda:<index> of the `count` it sees, identified by `uuid`
    (the physical device, whatever CUDA_VISIBLE_DEVICES each task was given)."""

    rank: int
    host: str
    count: int
    index: int = 0
    uuid: str = ""


def _my_placement(rank: int, local_rank: int, host: str) -> Placement:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return Placement(rank, host, 0)
    index = local_rank % count  # local rank -> GPU; Slurm's per-task binding leaves count 1
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return Placement(rank, host, count, index, str(uuid) if uuid is not None else f"{host}:{index}")


def choose_backend(backend: str | None, placements: list[Placement]) -> str:
    """The backend for every rank: NCCL when each rank has a GPU of its own, gloo on CPU.

    NCCL refuses two ranks on one GPU, which is what a 2-rank job on a 1-GPU machine would
    give; that is an error here naming the ranks, not a hang or a crash inside NCCL.
    """
    if backend not in (None, "gloo", "nccl"):
        raise BootstrapError(f"backend {backend!r} is not supported; allowed: 'gloo' (CPU), 'nccl' (GPU)")
    if backend == "gloo":
        return "gloo"
    blind = [p for p in placements if p.count == 0]
    if len(blind) == len(placements):
        if backend == "nccl":
            raise BootstrapError("backend 'nccl' needs CUDA GPUs, and torch sees none; use backend='gloo' on CPU")
        return "gloo"
    if blind:
        p = blind[0]
        raise BootstrapError(
            f"rank {p.rank} on {p.host} sees no GPU while other ranks do: give every rank a GPU, "
            "or hide them from all (CUDA_VISIBLE_DEVICES=) to run on CPU with gloo")
    taken: dict[tuple[str, str], Placement] = {}
    for p in placements:
        other = taken.setdefault((p.host, p.uuid), p)
        if other is not p:
            n = sum(q.host == p.host for q in placements)
            raise BootstrapError(
                f"ranks {other.rank} and {p.rank} on {p.host} would share one GPU (cuda:{p.index}, "
                f"{p.uuid}): {n} ranks on that node see {p.count} GPU(s), and NCCL needs one GPU per "
                f"rank. Start at most {p.count} rank(s) per node (tasks_per_node), or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES=) to run these ranks on CPU with gloo")
    return "nccl"


def init_distributed(comm: Any = None, backend: str | None = None, timeout_s: float = 300.0) -> DistEnv:
    """Bootstrap this rank: mpi4py world (or `comm`) -> torch.distributed default group.

    Collective over `comm` (default MPI.COMM_WORLD). Honours MASTER_ADDR / MASTER_PORT when set
    (on rank 0's side: the address to bind and advertise, the port to use). Torch ranks equal
    the ranks of `comm`.
    """
    MPI = _import_mpi()

    given = comm is not None
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    _check_world_size(size, given)
    if dist.is_initialized():
        raise BootstrapError("torch.distributed is already initialised in this process; call init_distributed once")

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    # Node index: number the shared-memory domains by their lowest global rank.
    leaders = comm.allgather(rank if local_rank == 0 else None)
    leader_ranks = sorted(r for r in leaders if r is not None)
    node_rank = leader_ranks.index(local.bcast(rank, root=0))
    local.Free()
    node = os.environ.get("SLURMD_NODENAME") or MPI.Get_processor_name()
    host = socket.gethostname()
    placements = comm.allgather(_my_placement(rank, local_rank, host))
    # Loopback is enough when every rank runs on this very host (same kernel hostname), even
    # if MPI sees several nodes (several slurmd on one machine).
    one_host = len({p.host for p in placements}) == 1

    # Rank 0 decides backend, address and port; any error travels with the broadcast.
    listener = None
    decision: dict[str, Any] = {}
    if rank == 0:
        try:
            decision["backend"] = choose_backend(backend, placements)
            env_addr = os.environ.get("MASTER_ADDR")
            addr = env_addr or _local_address(multi_node=not one_host)
            port_s = os.environ.get("MASTER_PORT", "0")
            if not port_s.isdigit() or int(port_s) > 65535:
                raise BootstrapError(f"MASTER_PORT={port_s!r} is not a port number (0..65535)")
            listener = _open_listener(addr, int(port_s))
            decision.update(addr=addr, port=listener.getsockname()[1])
        except BootstrapError as exc:
            decision["error"] = str(exc)
    decision = comm.bcast(decision, root=0)
    if "error" in decision:
        raise BootstrapError(decision["error"])
    be = decision["backend"]

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        decision["addr"],
        decision["port"],
        size,
        rank == 0,
        timeout,
        master_listen_fd=listener.fileno() if listener is not None else None,
    )
    if listener is not None:
        # The store owns the listening fd now and closes it when it goes; the socket object
        # must not close it too (later, that fd number may be another file of this process).
        listener.detach()
    device = "cpu"
    if be == "nccl":
        device = f"cuda:{placements[rank].index}"
        torch.cuda.set_device(device)
    dist.init_process_group(be, store=store, rank=rank, world_size=size, timeout=timeout)
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise BootstrapError(
            f"torch.distributed ranks ({dist.get_rank()}/{dist.get_world_size()}) differ from MPI's ({rank}/{size})"
        )
    return DistEnv(
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_size=local_size,
        node=node,
        comm=comm,
        backend=be,
        device=device,
        node_rank=node_rank,
        num_nodes=len(leader_ranks),
        master_addr=decision["addr"],
        master_port=decision["port"],
        _store=(store, listener),
    )


def shutdown_distributed(env: DistEnv) -> None:
    """Tear down torch.distributed (collective); the MPI world stays up for mpi4py's finaliser."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # The rendezvous socket is the TCPStore's (env._store): it closes it when it goes.
