"""TensorRT-LLM's Ray instance inside a Slurm step: the environment its workers get (ray.init
mocked only for that: the engine's own start-up code runs), the CUDA_VISIBLE_DEVICES forms it
refuses, and TP larger than a node's GPUs refused at submit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import ConfigError, load_profile, load_run_config
from slurm_align.config.loading import check_runnable, trtllm_tp_fits_a_node
from slurm_align.generation import GenerationError
from slurm_align.generation.ray_env import (
    LAUNCHER_PREFIXES,
    RAY_PINS,
    TRTLLM_ENV,
    check_replica_gpus,
    parse_visible_devices,
    ray_init_kwargs,
    task_cpus,
    trtllm_ray_cpus,
)
from slurm_align.generation.trtllm_engine import TrtllmEngine, physical_gpu
from tests.integration.test_generation_trtllm import QWEN, megatron_full

# the fixture fake_trtllm: tensorrt_llm and ray recorded
from tests.unit.generation.test_trtllm_engine import fake_trtllm  # noqa: F401

JOB_ENV = {  # what a rank of `srun --mpi=pmix` / mpirun / Intel MPI sees, besides our rendezvous
    "SLURM_PROCID": "3", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n1", "SRUN_CPUS_PER_TASK": "4",
    "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.42.0", "PMI_FD": "7", "PRTE_MCA_x": "1",
    "OMPI_COMM_WORLD_RANK": "3",
    "OPAL_PREFIX": "/opt/ompi", "I_MPI_PMI_LIBRARY": "/usr/lib/libpmi.so", "HYDRA_LAUNCHER": "slurm",
    "MPICH_INTERFACE_HOSTNAME": "n1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "4,6",
    "RAY_ADDRESS": "10.0.0.1:6379", "RAY_GCS_SERVER_PORT": "6379",   # another Ray's, or a fixed port: kept out
}


def test_ray_workers_get_the_replicas_gpus_no_launcher_variables_and_trtllm_switches(fake_trtllm, monkeypatch,  # noqa: F811
                                                                                     tmp_path):
    _log, made = fake_trtllm
    for k, v in {**JOB_ENV, "KEEP_ME": "1", "PATH": os.environ["PATH"]}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5})   # this task's cpuset
    import slurm_align.generation.trtllm_engine as eng
    pack = eng.pack_bucket
    monkeypatch.setattr(eng, "pack_bucket", lambda t, device, dtype: pack(t, "cpu", dtype))  # no CUDA here
    engine = TrtllmEngine(QWEN, "cuda:1", workdir=str(tmp_path), ray_temp_dir=str(tmp_path / "ray"))
    engine.refit(megatron_full(QWEN, 0))
    env, init = made["ray_env"], made["ray_init"]
    assert env["CUDA_VISIBLE_DEVICES"] == "6"            # cuda:1 of this task = the node's GPU 6
    assert not [k for k in env if k.startswith(LAUNCHER_PREFIXES)], sorted(env)
    assert not set(JOB_ENV) - {"CUDA_VISIBLE_DEVICES"} & set(env)
    assert env["KEEP_ME"] == "1" and all(env[k] == v for k, v in TRTLLM_ENV.items())
    assert env["TLLM_NUMA_AWARE_WORKER_AFFINITY"] == "0"
    assert made["env"] == env                              # the LLM's workers are made in the same environment
    assert not set(RAY_PINS) & set(env)
    # 3 CPUs in the cpuset, but TensorRT-LLM's executor reserves TP + 4: Ray is given that many
    assert init["num_cpus"] == trtllm_ray_cpus(1) == 5 and init["num_gpus"] == 1 and init["address"] == "local"
    assert init["_temp_dir"] == str(tmp_path / "ray") and init["log_to_driver"] is True
    assert os.environ["PMIX_RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"   # restored


@pytest.mark.parametrize("cpuset, tp, want", [(1, 1, 5), (1, 4, 8), (3, 2, 6), (16, 2, 16)])
def test_ray_gets_the_cpuset_but_at_least_what_tensorrt_llm_reserves(monkeypatch, cpuset, tp, want):
    """TensorRT-LLM 1.2's Ray executor: a placement group of TP CPUs and two queue actors of 2
    CPUs each; fewer CPUs in the instance and they are never scheduled (start-up hangs)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpuset)))
    assert ray_init_kwargs(tp)["num_cpus"] == want


def test_two_private_ray_instances_on_one_node_each_schedule_what_tensorrt_llm_asks():
    """Real Ray (where installed: the trtllm extra): two replicas' private instances at once on
    this node, each from a one-CPU task, each schedules TensorRT-LLM's placement group and queue
    actors; each has a GCS of its own (no fixed port shared)."""
    pytest.importorskip("ray")
    cmd = [sys.executable, "-W", "ignore", "-m", "tests.programs.ray_private_prog", "1"]
    env = {**os.environ, "RAY_GCS_SERVER_PORT": "6379"}   # a pin in the job's environment is not obeyed
    # the first replica's instance is up and held while the second starts (each task on its own CPU)
    first = subprocess.Popen([*cmd, "300", "0"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        up = first.stdout.readline()   # the program prints it once all is scheduled, or ends
        assert up.startswith("RAY_PRIVATE_OK"), first.communicate(timeout=60)[1][-3000:]
        second = subprocess.run([*cmd, "0", "1"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False,
                                timeout=300)
        other = next((x for x in second.stdout.splitlines() if x.startswith("RAY_PRIVATE_OK")), "")
        assert second.returncode == 0 and other, second.stdout[-2000:] + second.stderr[-3000:]
    finally:
        first.terminate()
        first.communicate(timeout=60)
    assert up.split()[1] != other.split()[1], (up, other)   # a GCS each
    assert "cpus=5" in up and "cpus=5" in other, (up, other)


def test_ray_temp_dir_is_never_the_nodes_shared_one():
    a, b = ray_init_kwargs(1)["_temp_dir"], ray_init_kwargs(1)["_temp_dir"]
    assert a != b and not a.startswith("/tmp/ray") and len(a) < 40
    assert task_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("visible, index, want", [("4,6", 1, "6"), (None, 2, "2"), ("0", 0, "0")])
def test_physical_gpu_reads_cuda_visible_devices(monkeypatch, visible, index, want):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert physical_gpu(index) == want


@pytest.mark.parametrize("visible, message", [
    ("GPU-8f1c2a3b-1111-2222-3333-444455556666", "not GPU ordinals"),
    ("MIG-1c2a3b4d-aaaa-bbbb-cccc-ddddeeeeffff", "not GPU ordinals"),
])
def test_uuid_and_mig_forms_are_refused(monkeypatch, visible, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(GenerationError, match=message):
        physical_gpu(0)
    with pytest.raises(GenerationError, match="UUID or MIG"):
        parse_visible_devices(visible, 1)


@pytest.mark.parametrize("gpus, tp, message", [
    (["0", "0"], 2, "must be on different GPUs"),
    (["0"], 2, "1 GPU\\(s\\) for tensor_parallel=2"),
    (["0", "1", "2"], 2, "3 GPU\\(s\\) for tensor_parallel=2"),
    (["GPU-abc", "1"], 2, "not GPU ordinals"),
])
def test_replica_gpus_are_checked(gpus, tp, message):
    with pytest.raises(GenerationError, match=message):
        check_replica_gpus(gpus, tp)


def test_replica_gpus_that_fit(fake_trtllm, monkeypatch, tmp_path):  # noqa: F811
    assert check_replica_gpus(["3", "5"], 2) == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")   # identical per-task values, TP 2: refused before Ray starts

    class Comm:  # the replica's two ranks, both seeing "their" cuda:0 as the node's GPU 0
        def Get_rank(self):
            return 0

        def allgather(self, x):
            return [x, x]

        def gather(self, x, root=0):
            return [x, x]

        def bcast(self, x, root=0):
            return x

        def Barrier(self):
            pass

    from types import SimpleNamespace
    engine = TrtllmEngine(QWEN, "cuda:0", layout=SimpleNamespace(tp_size=2, pp_size=1, mp_comm=Comm()),
                          workdir=str(tmp_path))
    with pytest.raises(GenerationError, match="different GPUs"):
        engine.refit(megatron_full(QWEN, 0))
    assert "ray_init" not in fake_trtllm[1]


EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


def _gpu_run(tp: int):
    return load_run_config(EXAMPLE, ["generation.engine=trtllm", "model.num_attention_heads=16",
                                     "model.hidden_size=256", f"actor.tensor_parallel={tp}",
                                     "actor.pipeline_parallel=1", f"actor.data_parallel={32 // tp}"])


def test_tensor_parallel_larger_than_a_node_is_refused_at_submit():
    profile = load_profile("example-gpu-cluster")        # 8 GPUs per node for the actor
    assert profile.components["actor"].gpus_per_node == 8
    assert trtllm_tp_fits_a_node(_gpu_run(8), profile) == []
    (problem,) = trtllm_tp_fits_a_node(_gpu_run(16), profile)
    assert "actor.tensor_parallel" in problem and "got 16" in problem and "tensor_parallel <= 8" in problem
    with pytest.raises(ConfigError, match="share one node"):
        check_runnable(_gpu_run(16), profile)
    torch_run = load_run_config(EXAMPLE, ["model.num_attention_heads=16", "model.hidden_size=256",
                                          "actor.tensor_parallel=16", "actor.data_parallel=2"])
    assert trtllm_tp_fits_a_node(torch_run, profile) == []   # the torch engine generates at TP 1
