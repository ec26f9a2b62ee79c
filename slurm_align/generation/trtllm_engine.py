"""TensorRT-LLM generation engine on the 1.x line (extra `trtllm`, NVIDIA GPUs only).

Supported release: TensorRT-LLM 1.2.x (written against 1.2.1), its LLM API with the PyTorch
backend, the path current RL toolkits refit in place (../shared/TRTLLM.md, part B). Every
TensorRT-LLM call made here is checked on CPU against signatures extracted from the release's
sources (tests/unit/generation/test_trtllm_engine.py); running it needs a GPU (tests/gpu/run_gpu_checks.sh).

Refit, colocated (the generation workers share the training ranks' GPUs), per bucket of
whole layers (TrtllmOptions.bucket_mib):
1. every rank of a generation replica (the TP ranks of one refolded DP replica: layout.mp_comm)
   converts only that bucket's megatron tensors to HF names (trtllm_mapping.hf_bucket) and packs
   them, in the engine dtype, into ONE flat buffer on its own GPU: the extra GPU memory is one
   bucket, never a second model;
2. each rank makes CUDA IPC handles of views into that buffer (one cudaIpcMemHandle per bucket:
   torch shares a view as its storage's handle + offset, and the receiver opens a storage once),
   keyed by its GPU's UUID; the replica's requester (mp_comm rank 0) gathers them;
3. the requester calls LLM._collective_rpc("update_weights", (handles,)): TensorRT-LLM's own
   WorkerExtension (ray_worker_extension_cls) opens the handles of ITS GPU's UUID and reloads the
   tensors through the model's loader (which takes its TP slice of each full tensor); a last call
   with None finalizes (post-load processing, prefix cache reset);
4. a barrier on mp_comm: the staging buffer lives until every worker has copied it.
The first refit also creates the LLM, from a config.json only (trtllm_mapping.hf_config) with
load_format="dummy" (nothing read from disk); step 3 then puts the real weights in.

Memory around training (enable_sleep=True, TensorRT-LLM's virtual-memory tags): sleep() releases
every tag (weights, KV cache, sampler and executor buffers) before the train phase
(memory.generation_phase calls it); the next refit wakes everything but the KV cache first
(WEIGHT_TAGS, EXTRA_TAGS: the finalizing update needs the model's and executor's buffers), updates
the weights, finalizes, and only then wakes the KV cache (CACHE_TAGS), so the KV cache never
coexists with the refit's staging bucket and the training state. The KV cache is sized when the LLM is
created, inside the generation phase: the optimizer state and gradients are on the host then
(TrainingStateOffload, which empties torch's cache so TensorRT-LLM's worker processes see the
memory), and kv_cache_fraction is a share of the memory free at that moment. The training
process's own generation-time needs (its parameters: already allocated; one refit bucket) must
fit in the rest: the default 0.5 leaves half of the free memory for them; raise it when the
training model is small next to the GPU, lower it when refit buckets are large.

Why Ray: in 1.2 `_collective_rpc` (hence update_weights) is served only by the Ray
orchestrator; the default MPI orchestrator has no path to push weights into its workers. Each
requester starts a private local Ray instance, and creates the LLM (whose workers copy this
process's environment), in an environment that shows exactly its replica's GPUs and none of
the job's MPI/PMIx/Slurm variables (a worker importing tensorrt_llm would otherwise try to join
the job's PMIx world): generation/ray_env.py. TP must fit in a node (refused at submit).

generate: one SamplingParams per prompt (its per-sample seed), token ids in, no tokenizer; EOS
is a stop token kept in the output and end_id is -1 (nothing else ends a sample), is_end =
finish_reason 'stop'. Per-token log-probs are returned when sampling at temperature 1 (any
top-k/top-p): TensorRT-LLM 1.2's TorchSampler reports log_softmax of the raw logits (no
temperature, no top-k/top-p masking), which is GenerationOutput's distribution (temperature T,
before top-k/top-p) only at T = 1; otherwise, or when a step lacks the sampled token's entry,
None (rollout correction then has nothing to compare; config validation refuses that).
Every rank of the replica returns the same output (broadcast from the requester).
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from slurm_align.config.engines import TrtllmOptions, engine_options
from slurm_align.config.run import ModelConfig
from slurm_align.generation.base import pack_prompts
from slurm_align.generation.params import GenerationError, GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.ray_env import check_replica_gpus, parse_visible_devices, ray_init_kwargs, worker_environ
from slurm_align.generation.trtllm_mapping import check_full_names, hf_bucket, hf_config, hf_model_type

PINNED_VERSION = "1.2.1"
WORKER_EXTENSION = "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"
# Literal choices passed to TensorRT-LLM, each checked against the values the release accepts
# (tests/fixtures/gpu_api.json "literals"; tests/unit/generation/test_trtllm_engine.py).
SAMPLER = "TRTLLMSampler"      # honours SamplingParams.seed per request ("auto" = TorchSampler: one generator)
LOAD_FORMAT = "dummy"          # create from config.json alone; the refit brings the weights
ORCHESTRATOR = "ray"           # the only orchestrator serving _collective_rpc (update_weights, sleep)
ALLREDUCE = "NCCL"             # TensorRT-LLM's own all-reduce hurt convergence with several rollout instances
# TensorRT-LLM 1.2's releasable memory tags (ExecutorMemoryType): the weights, the model's and the
# executor's other buffers, and the KV cache. A refit wakes all but the KV cache before its first
# update_weights (the finalizing update_weights(None) runs the model's post-load processing and
# resets the executor's caches: their buffers must be there, as in veRL's order), and the KV
# cache last, once the staging buckets are gone.
WEIGHT_TAGS = ("model", "draft_model")
EXTRA_TAGS = ("sampler", "drafter", "guided_decoder", "spec_resource_manager", "model_extra", "executor_extra")
CACHE_TAGS = ("kv_cache",)
ALL_TAGS = WEIGHT_TAGS + EXTRA_TAGS + CACHE_TAGS
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_LAYER_PREFIX_PARTS = 3  # "model.layers.N." groups a layer's tensors into one bucket


def import_tensorrt_llm() -> Any:
    """Import tensorrt_llm only when the engine is used, with a clear message when missing."""
    if not torch.cuda.is_available():
        raise GenerationError("generation engine 'trtllm' needs a CUDA GPU; choose generation.engine 'torch'")
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as e:
        raise GenerationError(
            f"generation engine 'trtllm' needs TensorRT-LLM {PINNED_VERSION} and an NVIDIA GPU: use an "
            f"NVIDIA TensorRT-LLM container, or `pip install slurm-align[trtllm]` where NVIDIA's package "
            f"index is reachable; or choose generation.engine 'torch' ({e})") from e


def model_config_of(shape: GptShape | ModelConfig) -> ModelConfig:
    """The ModelConfig the HF mapping needs, from the engine's shape (fields it lacks keep
    ModelConfig's defaults, as for a GptShape without architecture fields)."""
    if isinstance(shape, ModelConfig):
        return shape
    arch = {f: getattr(shape, f) for f in ("position_embedding", "rotary_base", "rope_scaling", "normalization",
                                          "activation", "num_query_groups", "kv_channels", "add_bias_linear",
                                          "add_qkv_bias", "tie_embeddings", "qk_layernorm", "num_experts",
                                          "moe_router_topk", "moe_norm_topk_prob") if hasattr(shape, f)}
    return ModelConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                       num_attention_heads=shape.num_attention_heads, ffn_hidden_size=shape.ffn_hidden_size,
                       vocab_size=shape.vocab_size, max_seq_len=shape.max_seq_len,
                       norm_epsilon=getattr(shape, "norm_epsilon", shape.layernorm_epsilon), **arch)


def physical_gpu(index: int) -> str:
    """This process's cuda:<index> as its parent's ordinal (what CUDA_VISIBLE_DEVICES lists),
    so that processes started with another environment find the same GPU; UUID forms refused."""
    visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), index + 1)
    if index >= len(visible):
        raise GenerationError(
            f"cuda:{index} is not among CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    return visible[index]


def layer_buckets(names: Sequence[str], nbytes: dict[str, int], budget: int) -> list[list[str]]:
    """Names (HF `model.layers.N.` or megatron `decoder.layers.N.`) grouped into buckets of whole
    layers (a layer's q/k/v and gate/up go together, as the fused modules load them), each up to
    `budget` bytes unless one layer alone is larger."""
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        layered = n.startswith(("model.layers.", "decoder.layers."))
        key = ".".join(parts[:_LAYER_PREFIX_PARTS]) if layered else "rest"
        groups.setdefault(key, []).append(n)
    buckets: list[list[str]] = [[]]
    size = 0
    for group in groups.values():
        g = sum(nbytes[n] for n in group)
        if buckets[-1] and size + g > budget:
            buckets.append([])
            size = 0
        buckets[-1].extend(group)
        size += g
    return buckets


def pack_bucket(tensors: dict[str, torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat buffer on `device` holding every tensor of a bucket in `dtype`, and a view of it
    per name (what the IPC handles are made of: one storage, hence one CUDA IPC handle)."""
    total = sum(t.numel() for t in tensors.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    views, offset = {}, 0
    for name, t in tensors.items():
        view = flat[offset: offset + t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        views[name] = view
        offset += t.numel()
    return flat, views


class TrtllmEngine:
    """One TensorRT-LLM LLM per generation replica; every rank of the replica holds an engine
    object (the requester owns the LLM, the others stage their GPU's weights and get outputs)."""

    def __init__(self, shape: GptShape | ModelConfig, device: torch.device | str = "cuda", *,
                 layout: Any = None, **options: Any):
        self.model_cfg = model_config_of(shape)
        self.shape = shape if isinstance(shape, GptShape) else GptShape.from_model_config(shape)
        self.options: TrtllmOptions = engine_options(TrtllmOptions, "trtllm", options)  # type: ignore[assignment]
        hf_model_type(self.model_cfg)  # refuse a model TensorRT-LLM cannot run now, not at the first refit
        self.device = torch.device(device)
        self.torch_dtype = _DTYPES[self.options.dtype]
        self.tp_size = layout.tp_size if layout is not None else 1
        self.comm = layout.mp_comm if layout is not None and self.tp_size > 1 else None
        self.is_requester = self.comm is None or self.comm.Get_rank() == 0
        self.workdir = Path(self.options.workdir or tempfile.mkdtemp(prefix="slurm_align_trtllm_"))
        self.max_input_len = self.options.max_input_len or self.shape.max_seq_len
        if self.max_input_len > self.shape.max_seq_len:
            raise GenerationError(f"trtllm max_input_len={self.max_input_len} > the model's max_seq_len="
                                  f"{self.shape.max_seq_len}")
        self.max_num_tokens = self.options.max_num_tokens or max(8192, self.max_input_len)
        if self.max_num_tokens < self.max_input_len:
            raise GenerationError(f"trtllm max_num_tokens={self.max_num_tokens} < max_input_len="
                                  f"{self.max_input_len}: a prompt's prefill must fit in one iteration")
        self._llm: Any = None
        self._loaded = False
        self.asleep: set[str] = set()   # TensorRT-LLM memory tags released (sleep) and not woken yet

    @classmethod
    def for_layout(cls, shape: GptShape | ModelConfig, layout: Any, device: torch.device | str = "cuda",
                   **options: Any) -> TrtllmEngine:
        """This rank's engine in a GenerationLayout: TP = the layout's, one LLM per replica."""
        if layout.pp_size != 1:
            raise GenerationError("generation engine 'trtllm': generate with switches.refold on "
                                  "(pipeline stages refolded into data parallel; TensorRT-LLM runs TP only)")
        return cls(shape, device, layout=layout, **options)

    # -- refit -------------------------------------------------------------------------------
    def refit(self, full_state_dict: dict[str, torch.Tensor]) -> float:
        """Collective over the replica: new weights into the LLM in place (created the first time).
        Order: wake everything but the KV cache, update the weights bucket by bucket, finalize,
        wake the KV cache."""
        t0 = time.perf_counter()
        import_tensorrt_llm()
        # Deferred: tensorrt_llm is an optional GPU-only package (see import_tensorrt_llm).
        from tensorrt_llm._torch.utils import get_device_uuid

        names = check_full_names(full_state_dict, self.model_cfg)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = get_device_uuid(index)  # the key a worker looks its handles up by (its GPU's UUID)
        if not self._loaded:  # first refit, or after free(): the requester creates the LLM
            try:
                mine_gpu: Any = physical_gpu(index)
            except GenerationError as e:  # passed on, so that every rank of the replica refuses
                mine_gpu = ("error", str(e))
            gpus = self.comm.allgather(mine_gpu) if self.comm is not None else [mine_gpu]
            errors = [g[1] for g in gpus if isinstance(g, tuple)]
            if errors:
                raise GenerationError(errors[0])
            check_replica_gpus(gpus, self.tp_size)  # on every rank: all refuse together, none waits
            if self.is_requester:
                self._llm = self._create_llm(gpus)
            self.asleep.clear()
        self._wake(WEIGHT_TAGS + EXTRA_TAGS)   # everything but the KV cache (see ALL_TAGS)
        budget = self.options.bucket_mib << 20
        nbytes = {k: full_state_dict[k].numel() * self.torch_dtype.itemsize for k in names}
        for bucket in layer_buckets(names, nbytes, budget):
            hf = hf_bucket(full_state_dict, bucket, self.model_cfg)
            flat, views = pack_bucket(hf, self.device, self.torch_dtype)
            del hf  # converted copies (on the training device) go before the next bucket
            torch.cuda.synchronize(self.device)
            mine = (uuid, [(k, reduce_tensor(v)) for k, v in views.items()])
            shares = self.comm.gather(mine, root=0) if self.comm is not None else [mine]
            if self.is_requester:
                self._llm._collective_rpc("update_weights", args=(dict(shares),))
            if self.comm is not None:
                self.comm.Barrier()  # every worker has copied this bucket: the buffer may go
            del views, flat
        if self.is_requester:
            self._llm._collective_rpc("update_weights", args=(None,))  # finalize
        self._wake(CACHE_TAGS)
        if self.comm is not None:
            self.comm.Barrier()
        self._loaded = True
        torch.cuda.empty_cache()  # the staging buffers' memory back to the driver (the workers')
        return time.perf_counter() - t0

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Materialize the released tags among `tags` (a tag never released is left alone)."""
        wake = [t for t in tags if t in self.asleep]
        if wake and self.is_requester:
            self._llm._collective_rpc("wakeup", args=(wake,))
        self.asleep -= set(wake)

    def sleep(self) -> None:
        """Release the LLM's GPU memory (weights, KV cache, buffers) for the train phase; the next
        refit wakes it. Collective over the replica."""
        if not self._loaded or self.asleep >= set(ALL_TAGS):
            return
        if self.is_requester:
            self._llm._collective_rpc("sleep", args=(list(ALL_TAGS),))
        self.asleep = set(ALL_TAGS)
        if self.comm is not None:
            self.comm.Barrier()
        torch.cuda.empty_cache()

    def _create_llm(self, gpus: list[str]) -> Any:
        # Deferred: tensorrt_llm and ray are optional GPU-only packages (see import_tensorrt_llm).
        import ray
        from tensorrt_llm import LLM
        from tensorrt_llm.llmapi import KvCacheConfig

        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.json").write_text(json.dumps(hf_config(self.model_cfg), indent=1))
        # enable_block_reuse off: prompts are not shared across steps, and reused blocks would
        # hold KV computed with the previous weights.
        kv = KvCacheConfig(free_gpu_memory_fraction=self.options.kv_cache_fraction, enable_block_reuse=False)
        with worker_environ(gpus):
            if not ray.is_initialized():  # a private instance (the LLM attaches to it, leaves it running)
                ray.init(**ray_init_kwargs(len(gpus), self.options.ray_temp_dir))
            return LLM(model=str(self.workdir), skip_tokenizer_init=True, tensor_parallel_size=self.tp_size,
                       dtype=self.options.dtype, orchestrator_type=ORCHESTRATOR,
                       ray_worker_extension_cls=WORKER_EXTENSION, load_format=LOAD_FORMAT,
                       max_batch_size=self.options.max_batch_size, max_seq_len=self.shape.max_seq_len,
                       max_input_len=self.max_input_len, max_num_tokens=self.max_num_tokens,
                       kv_cache_config=kv, sampler_type=SAMPLER, enable_sleep=True, allreduce_strategy=ALLREDUCE)

    def free(self) -> None:
        """Shut the LLM down (weights and KV cache); the next refit creates it again."""
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        self._loaded = False
        self.asleep.clear()
        torch.cuda.empty_cache()

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        """Collective over the replica (every rank passes the same prompts)."""
        if not self._loaded or self.asleep:
            raise GenerationError("TrtllmEngine: no weights (or asleep); call refit(full_state_dict) first")
        batch = pack_prompts(prompts, self.shape, params, seeds, torch.device("cpu"))  # checks + seeds
        out = self._generate(prompts, params, batch.seeds.tolist()) if self.is_requester else None
        return self.comm.bcast(out, root=0) if self.comm is not None else out

    def _generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, seeds: list[int]) -> GenerationOutput:
        # Deferred: tensorrt_llm is an optional GPU-only package (see import_tensorrt_llm).
        from tensorrt_llm import SamplingParams as TrtSamplingParams

        # Its log-probs ignore temperature and top-k/top-p masking: ours only at temperature 1.
        want_lp = params.return_logprobs and not params.greedy and params.temperature == 1.0
        stop = native_stop_ids(params) or None
        greedy = params.greedy  # top_k 1; TensorRT-LLM's top_k 0 / top_p 1 mean "all", as ours
        per_sample = [TrtSamplingParams(max_tokens=params.max_new_tokens, seed=s, end_id=-1, stop_token_ids=stop,
                                        include_stop_str_in_output=True, logprobs=1 if want_lp else None,
                                        detokenize=False, top_k=1 if greedy else params.top_k,
                                        temperature=None if greedy else params.temperature,
                                        top_p=None if greedy else params.top_p) for s in seeds]
        results = self._llm.generate([p.reshape(-1).tolist() for p in prompts], sampling_params=per_sample,
                                     use_tqdm=False)
        return self._collect(results, params, want_lp)

    def _collect(self, results: list, params: SamplingParams, want_lp: bool) -> GenerationOutput:
        return collect_outputs(results, params, want_lp)


def collect_outputs(results: list, params: SamplingParams, want_lp: bool,
                    sequence_stop: str | None = None) -> GenerationOutput:
    """GenerationOutput from an LLM API's per-prompt results (TensorRT-LLM's and vLLM's share the
    shape: outputs[0] with token_ids, finish_reason, stop_reason and per-step log-prob dicts).
    `sequence_stop`: the stop_reason of a sample the engine ended at one of the stop token
    sequences itself (vLLM's, vllm_scheduler.STOP_REASON): ended, its ids kept as they are."""
    n, m = len(results), params.max_new_tokens
    stops = set(native_stop_ids(params))
    tokens = torch.full((n, m), params.pad_id, dtype=torch.int64)
    logprobs = torch.zeros(n, m, dtype=torch.float32) if want_lp else None
    lengths = torch.zeros(n, dtype=torch.int64)
    is_end = torch.zeros(n, dtype=torch.bool)
    for i, r in enumerate(results):
        c = r.outputs[0]
        ids = list(c.token_ids)[:m]
        at_sequence = sequence_stop is not None and c.finish_reason == "stop" and c.stop_reason == sequence_stop
        ended = at_sequence or (bool(stops) and c.finish_reason == "stop")
        if ended and not at_sequence and (not ids or ids[-1] not in stops):  # stop token left out of the ids
            last = c.stop_reason if c.stop_reason in stops else params.eos_id
            if last is not None:
                ids = [*ids[:m - 1], last]
            logprobs = None
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        lengths[i], is_end[i] = len(ids), ended
        if logprobs is not None:
            lp = _sampled_logprobs(c.logprobs, ids)
            if lp is None:
                logprobs = None
            else:
                logprobs[i, : len(lp)] = torch.tensor(lp)
    width = int(lengths.max()) if n else 0
    return GenerationOutput(tokens[:, :width], lengths, is_end, None if logprobs is None else logprobs[:, :width])


def native_stop_ids(params: SamplingParams) -> list[int]:
    """The stops TensorRT-LLM ends a sample at itself (`stop_token_ids`): EOS and every stop
    sequence of one token (e.g. Qwen's `</tool_call>` and `<|im_end|>`). Its token-sequence stops
    come only from `stop` strings through its own tokenizer, so a longer stop sequence is cut
    afterwards by the multi-turn loop (conversations.stop_cut): the engine may generate past it."""
    ids = [params.eos_id] if params.eos_id is not None else []
    return ids + [q[0] for q in params.stop_token_sequences if len(q) == 1 and q[0] not in ids]


def _sampled_logprobs(per_step: Any, ids: list[int]) -> list[float] | None:
    """The sampled token's log-prob at each step, from TensorRT-LLM's per-step entries (a dict
    token -> Logprob, or a plain float); None when a step does not carry it."""
    if per_step is None or len(per_step) < len(ids):
        return None
    out = []
    for step, tok in zip(per_step, ids):
        if isinstance(step, dict):
            entry = step.get(tok)
            if entry is None:
                return None
            out.append(float(getattr(entry, "logprob", entry)))
        else:
            out.append(float(step))
    return out
