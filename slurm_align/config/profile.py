"""Cluster profiles: where and how a run's components get their nodes.

A profile is a YAML file in cluster_profiles/ (or a user's own folder, or any path).
`kind: local` runs the components as local mpirun process groups with the environment a
Slurm hetjob would give them; `kind: slurm` submits one heterogeneous sbatch job.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from slurm_align.config.base import StrictModel
from slurm_align.config.components import component_kinds

# sbatch option names are lower-case words joined by dashes; anything else is refused.
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$|^UNLIMITED$")
# Keys of sbatch_extra the template already owns; overriding them silently would break the job.
_OWNED_SBATCH = {"nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "output", "error",
                 "job-name", "partition", "account", "qos", "time", "het-group", "hetjob"}
# srun options slurm-align renders itself; a second copy in srun_extra would silently win or clash.
_OWNED_SRUN = {"-c", "--cpus-per-task", "--cpu-bind", "--gpus-per-task", "--gpu-bind", "--mpi",
               "--het-group", "--kill-on-bad-exit", "--wait", "-W", "-K", "--container-image",
               "--container-mounts", "--container-workdir", "--container-name"}


def _scalars_as_text(v):
    # YAML reads `OMP_NUM_THREADS: 1` as an int; the shell and sbatch see text anyway.
    if isinstance(v, dict):
        return {k: (str(x).lower() if isinstance(x, bool) else str(x))
                if isinstance(x, (int, float, bool)) else x for k, x in v.items()}
    return v


def _check_sbatch_keys(v: dict[str, str]) -> dict[str, str]:
    for key in v:
        if not _SBATCH_KEY.match(key):
            raise ValueError(f"sbatch_extra key {key!r} is not an sbatch option name (a-z, 0-9, '-')")
        if key in _OWNED_SBATCH:
            raise ValueError(f"sbatch_extra key {key!r} is set by slurm-align; use the profile field instead")
    return v


def time_limit_seconds(text: str) -> int | None:
    """sbatch's --time forms in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S; None for UNLIMITED."""
    if text == "UNLIMITED":
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:   # D-H, D-H:M, D-H:M:S
        parts += [0] * (3 - len(parts))
        h, m, s = parts
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    h, m, s = parts
    return (h * 60 + m) * 60 + s


class ComponentResources(StrictModel):
    """Resources of one hetjob component (actor, critic or generator)."""

    nodes: int = Field(1, ge=1)
    """Nodes for this component (components never share a node)."""
    tasks_per_node: int = Field(1, ge=1)
    """MPI ranks per node (one per GPU on GPU clusters)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node (0 on CPU clusters)."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores per rank."""
    mem: str | None = None
    """Memory per node as sbatch takes it (e.g. '64G'); default: the partition's."""
    partition: str | None = None
    """Partition for this component only; default: the profile's."""
    time: str | None = None
    """Refused when set: a job has ONE time limit (the profile's `time`). With a limit per
    component, one component would reach its limit first and be killed, while the warning signal
    (`--signal=B:USR2@grace`) reaches only the batch shell and stops the run at the first limit."""

    cpu_bind: str = "cores"
    """srun `--cpu-bind` for this component's ranks ('cores', 'none', 'sockets', 'map_cpu:...');
    with `-c cpus_per_task` each rank gets its own cores. Clusters with TaskPlugin=task/none
    (the local test cluster) print 'lacks support for cpu binding' and run unbound."""
    gpus_per_task: int | None = Field(None, ge=1)
    """srun `--gpus-per-task` (each rank sees only its own GPUs); default: not passed (every rank
    sees the node's GPUs and picks its own by local rank)."""
    gpu_bind: str | None = None
    """srun `--gpu-bind` (e.g. 'closest', 'single:1', 'none'); default: not passed."""
    srun_extra: list[str] = Field(default_factory=list)
    """Extra srun options for this component, each a whole option ('--network=sn_single'),
    shell-quoted in the script."""
    sbatch_extra: dict[str, str] = Field(default_factory=dict)
    """Extra `#SBATCH --key=value` lines for this component only (after the profile's own)."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node

    @field_validator("sbatch_extra", mode="before")
    @classmethod
    def _scalars_as_text(cls, v):
        return _scalars_as_text(v)

    @field_validator("sbatch_extra")
    @classmethod
    def _sbatch_keys(cls, v):
        return _check_sbatch_keys(v)

    @field_validator("srun_extra")
    @classmethod
    def _srun_options(cls, v):
        for opt in v:
            if not opt.startswith("-"):
                raise ValueError(f"srun_extra entry {opt!r} is not an option (each entry is one whole "
                                 "option such as '--network=sn_single')")
            name = opt.split("=", 1)[0]
            if name in _OWNED_SRUN:
                raise ValueError(f"srun_extra entry {opt!r}: {name} is set by slurm-align; use the "
                                 "component's field instead (cpus_per_task, cpu_bind, gpus_per_task, gpu_bind)")
        return v

    @field_validator("time", mode="before")
    @classmethod
    def _one_time_limit(cls, v):
        if v is not None:
            raise ValueError("a per-component time limit is not supported: the job has one time limit, "
                             "the profile's 'time' (a component that reached its own limit first would "
                             "be killed while the warning signal reaches only the batch shell); remove "
                             "it and set the profile's 'time'")
        return v


class ContainerConfig(StrictModel):
    image: str
    """Container image (pyxis/enroot `--container-image`): `REGISTRY#IMAGE:TAG` (imported on each
    node) or the path of a squashfs file made once with `enroot import` (on a shared file system)."""
    mounts: list[str] = Field(default_factory=list)
    """Extra bind mounts 'src:dst[:flags]'. The run directory and every input path of the run
    (data, checkpoints, HF folders, tokenizer files) are mounted at their own paths anyway."""
    mount_home: bool = False
    """Mount the user's home directory (pyxis's default); false: `--no-container-mount-home`, so
    nothing in ~ (a login-node venv, ~/.local packages) leaks into the container."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run inside the container before each rank (and the pre-flight) starts, e.g.
    `source /opt/env.sh` (trusted: written by the profile's owner). Written to
    RUN_DIR/container_setup.sh at submit."""


class NetworkConfig(StrictModel):
    interface: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Network interface of the high-speed network on the compute nodes (e.g. 'ib0', 'hsn0'):
    the critic binds to its address (else to Slurm's NodeAddr, often the management Ethernet),
    torch's rendezvous uses it, and NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME are set to it
    (unless `env` sets them)."""


Dtype = Literal["bf16", "fp16", "fp32"]


class HardwareConfig(StrictModel):
    """Speeds of one rank's device and of the links between ranks, for the step-time plan
    (`slurm-align plan`, slurm_align/planning/steptime.py). Every field is optional: what is
    left out comes from the defaults of `accelerator` (planning/hardware.py documents them and
    where each figure comes from). Peak figures are dense (no sparsity), per rank: one GPU, or
    on CPU one rank with its cpus_per_task cores."""

    accelerator: Literal["H100", "H200", "A100", "cpu"] = "cpu"
    """Whose defaults fill the fields below (H100/H200/A100 SXM, or this project's CPU)."""
    peak_tflops: dict[Dtype, float] = Field(default_factory=dict)
    """Peak matmul TFLOP/s per rank by dtype, e.g. {bf16: 989}; missing dtypes: the defaults."""
    memory_bandwidth_gbs: float | None = Field(None, gt=0)
    """Device memory bandwidth per rank, GB/s (decode reads weights and KV cache at this rate)."""
    intra_node_gbs: float | None = Field(None, gt=0)
    """Bandwidth between two ranks of one node, GB/s per direction (NVLink; shared memory on CPU)."""
    inter_node_gbs: float | None = Field(None, gt=0)
    """Bandwidth between ranks of different nodes, GB/s per direction per rank (the NIC's share)."""
    intra_node_latency_us: float | None = Field(None, ge=0)
    """Latency of one collective (an all-reduce of a few bytes) among ranks of one node, us: what
    tensor parallelism pays per layer and decoded token whatever the bytes."""
    inter_node_latency_us: float | None = Field(None, ge=0)
    """Latency of one collective among ranks of different nodes, us."""
    shared_host: bool = False
    """All nodes of this profile are the machine that makes the plan (the local test cluster: its
    'nodes' are slurmd processes on one host), so ranks running at once share its cores
    (os.cpu_count()) rather than each getting cpus_per_task of its own."""


def _every_component() -> dict[str, ComponentResources]:
    """ClusterProfile.components' default: default resources for each registered component kind."""
    return {k.resource_key: ComponentResources() for k in component_kinds()}


class ClusterProfile(StrictModel):
    """How to run on one cluster (or locally)."""

    name: str = "unnamed"
    """Profile name (the file's stem when loaded from a file)."""
    kind: Literal["local", "slurm"] = "slurm"
    """'local': no Slurm, mpirun process groups; 'slurm': a real (het)job."""
    partition: str | None = None
    """Default partition (required for kind 'slurm')."""
    account: str | None = None
    """Account to charge."""
    qos: str | None = None
    """Quality of service."""
    time: str = "01:00:00"
    """Default time limit."""
    constraint: str | None = None
    """Node feature constraint (sbatch --constraint)."""
    components: dict[Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$")], ComponentResources] = Field(
        default_factory=_every_component)
    """Per-component resources, keyed by a registered component kind (config/components.py:
    actor, critic, generator, ...; checked against the run at submit); sft/rm/dpo jobs use
    'actor'; 'generator' is the rollout generator of rollout.mode 'disaggregated' (it may sit on
    a partition of its own)."""
    modules: list[str] = Field(default_factory=list)
    """Environment modules to `module load` before the job runs."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before the components start (trusted: written by the profile's owner)."""
    python: str | None = None
    """Python interpreter in the job (a venv's bin/python, or the container's); default: the
    interpreter that runs `slurm-align` (right for a venv on a shared file system), or with a
    container the container's `python3`. It must have slurm-align installed: ranks run
    `python -m slurm_align.launchers.<name>`."""
    container: ContainerConfig | None = None
    """Run each component in this container (pyxis)."""
    job_shape: Literal["hetjob", "single"] = "hetjob"
    """'hetjob': one heterogeneous job, a component each. 'single': one plain job over all the
    components' nodes, each component an srun on a node set of its own (for sites that count every
    hetjob component against a QOS MaxJobs or disable heterogeneous jobs); addresses, preemption
    and status work the same."""
    network: NetworkConfig = NetworkConfig()
    """Which network the job's own traffic uses."""
    env: dict[str, str] = Field(default_factory=dict)
    """Plain environment variables exported in the job (values are shell-quoted)."""
    secret_env: list[str] = Field(default_factory=list)
    """Names of secret variables (e.g. WANDB_API_KEY) that the job inherits from the submitting
    shell; only the names are ever written, never the values."""
    mpi: str = "pmix"
    """srun --mpi plugin (pmix, pmi2, none)."""
    mpirun: str = "mpirun"
    """mpirun command (local profile only)."""
    srun_wait_s: int = Field(0, ge=0)
    """srun `--wait`: seconds srun lets the other ranks run on after the first rank of a component
    ended. 0 (the default): no limit, so a rank that finishes its save later than the others is not
    killed; a rank that fails still ends the component at once (`--kill-on-bad-exit=1`), and the
    job script then stops the other components. Rendered always, so a site's WaitTime does not
    apply silently."""
    sbatch_extra: dict[str, str] = Field(default_factory=dict)
    """Extra `#SBATCH --key=value` lines for the whole job."""
    hostname_pattern: str | None = None
    """Regex searched in the login node's hostname: without --profile, the first profile whose
    pattern matches is taken (slurm_align.slurm.choose). On a machine with sbatch and no match,
    submit refuses rather than run on the login node."""
    run_root: str | None = None
    """Folder for new run directories when --run-dir is not given (e.g. '$SCRATCH/slurm-align';
    $VARS and ~ are expanded at submit); default ./runs. It must be on a file system every node
    sees."""
    shared_tmp: bool = False
    """The compute nodes share /tmp (and the other usually node-local folders) with the submitting
    machine: only true for a one-host cluster such as the local test cluster. False: a 'slurm'
    profile refuses a run directory or interpreter under /tmp, /var/tmp, /dev/shm, /run, /local."""
    precision: Dtype | None = None
    """The `training.precision` of runs on this profile whose config does not set it (the shipped
    GPU example: bf16); unset: the run's own default, fp32 (the CPU profiles)."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Memory of one GPU in GiB (e.g. 80 for an H100 80GB). When set, `submit` refuses a run whose
    memory plan (`slurm-align plan`) exceeds it on any component; default: not checked."""
    signal_grace_s: int = Field(300, ge=0, le=65535)
    """Seconds before the time limit at which Slurm warns the job (`#SBATCH --signal=B:USR2@N`):
    the actor ranks then agree on a stop point at the next step boundary and every role saves
    (actor, critic with its optimizer state, RNG, data position). Make it longer than one step
    plus one checkpoint. 0: no warning (the job is killed at its limit). A preemption sends the
    same signal only where the cluster sets `PreemptParameters=send_user_signal`."""
    preempt_grace_s: int = Field(0, ge=0, le=65535)
    """Seconds the run allows itself between Slurm's SIGTERM and its SIGKILL when Slurm preempts
    the job: the preemptible partition's GraceTime (`scontrol show partition`). At a TERM the
    actor finishes the step in flight and saves it when that fits: the step, taking as long as
    the job's previous one with its save (the job's first step: tried), ends within this minus
    5 s for the exit; otherwise, or when it has not ended by then, it stops at once at its newest
    checkpoint and the step in flight is redone after the restart. The critic serves on until
    the actor has stopped (at most this plus 30 s). 0 (Slurm's default GraceTime): stop at once.
    A plain `scancel` sends the same TERM with Slurm's KillWait (30 s by default) before the
    KILL instead."""
    requeue: bool = False
    """After a stop for preemption or the time limit, requeue the job (`scontrol requeue`): the same
    job id starts again and resumes from the checkpoint. False: the job ends with
    'stopped for preemption at step N' (resume it later with `slurm-align submit --resume`)."""
    max_requeues: int = Field(3, ge=0)
    """Requeues allowed per submission (counted in RUN_DIR/requeue_count); past it the job ends
    as with requeue false."""
    hardware: HardwareConfig = HardwareConfig()
    """Device and network speeds for the step-time plan (`slurm-align plan`); default: this
    project's CPU figures."""

    @field_validator("time", mode="before")
    @classmethod
    def _minutes_as_text(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v   # YAML `time: 30`

    @field_validator("time")
    @classmethod
    def _time_format(cls, v):
        if not _TIME.match(v):
            raise ValueError("time must look like MM, HH:MM:SS or D-HH:MM:SS")
        return v

    @field_validator("sbatch_extra", "env", mode="before")
    @classmethod
    def _scalars_as_text(cls, v):
        return _scalars_as_text(v)

    @field_validator("sbatch_extra")
    @classmethod
    def _sbatch_keys(cls, v):
        return _check_sbatch_keys(v)

    @field_validator("env", "secret_env")
    @classmethod
    def _variable_names(cls, v, info):
        for key in v:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{info.field_name} name {key!r} is not a valid variable name "
                                 "(letters, digits and _, not starting with a digit)")
        return v

    @field_validator("hostname_pattern")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"hostname_pattern is not a valid regex: {e}") from None
        return v

    @field_validator("mpi")
    @classmethod
    def _mpi(cls, v):
        allowed = ("pmix", "pmix_v3", "pmix_v4", "pmix_v5", "pmi2", "none", "cray_shasta")
        if v not in allowed:
            raise ValueError(f"mpi must be one of {', '.join(allowed)}")
        return v

    @model_validator(mode="after")
    def _grace_within_time_limit(self):
        seconds = time_limit_seconds(self.time)
        if self.signal_grace_s and seconds is not None and self.signal_grace_s >= seconds:
            raise ValueError(f"signal_grace_s={self.signal_grace_s} must be shorter than time={self.time!r} "
                             f"({seconds} s), or the warning would come before the job starts")
        return self

    @model_validator(mode="after")
    def _real_cluster_needs_partition(self):
        if self.kind == "slurm" and not self.partition:
            missing = [c for c, r in self.components.items() if not r.partition]
            if missing:
                raise ValueError(
                    "a 'slurm' profile must name a partition (profile 'partition', or one per component); "
                    f"missing for: {', '.join(missing)}")
        return self

    def resources(self, component: str) -> ComponentResources:
        """The resources of a component (by its kind's resource key, when it is a registered kind)."""
        kinds = {k.name: k.resource_key for k in component_kinds()}
        key = kinds.get(component, component)
        if key not in self.components:
            raise KeyError(key)
        return self.components[key]
