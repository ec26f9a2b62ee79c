"""Each generation engine's own settings: `generation.vllm` and `generation.trtllm` of the run config,
validated like the rest of it, and the keyword arguments make_engine passes to the engine
(slurm_align/generation/vllm_engine.py, trtllm_engine.py), which validate them with the same
models. Only the section of the chosen generation.engine is used."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from slurm_align.config.base import StrictModel


class VllmOptions(StrictModel):
    """vLLM (generation.engine 'vllm'): see slurm_align/generation/vllm_engine.py for memory and sleep."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights and activations in vLLM. Default: the dtype of the weights of the first refit."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences vLLM schedules at once. Default 256."""
    gpu_memory_utilization: float = Field(0.4, gt=0.0, lt=1.0)
    """GPUs: vLLM's share of the GPU's TOTAL memory (weights + KV cache), not of the free memory;
    colocated with training it must leave the trainer's generation-time memory out. Default 0.4."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (each costs seconds to minutes at every engine start, and the
    weights change in place every step). Default true."""
    sleep_mode: bool | None = None
    """Release weights and KV cache around training (vLLM's sleep level 1). Default: on GPUs yes,
    on CPU no (vLLM has no sleep mode on CPU: true is refused there)."""
    cpu_kv_cache_mib: int | None = Field(None, ge=1)
    """CPU: the KV cache's host memory in MiB. Default: enough for max_num_seqs sequences of the
    model's max_seq_len."""
    bucket_mib: int = Field(512, ge=0)
    """Refit: HF-converted weights per load call, in MiB (whole layers; at least one: 0 sends one
    layer per call). Default 512."""
    workdir: str | None = None
    """Where config.json of the generation model goes. Default: a fresh temp folder."""


class TrtllmOptions(StrictModel):
    """TensorRT-LLM (generation.engine 'trtllm'): see slurm_align/generation/trtllm_engine.py."""

    dtype: Literal["bfloat16", "float16"] = "bfloat16"
    """Weights and activations. Default bfloat16."""
    max_batch_size: int = Field(256, ge=1)
    """Requests TensorRT-LLM schedules at once. Default 256."""
    kv_cache_fraction: float = Field(0.5, gt=0.0, lt=1.0)
    """Share of the GPU memory free when the LLM is created (training state offloaded, weights
    loaded) that the KV cache takes. Default 0.5."""
    bucket_mib: int = Field(512, ge=0)
    """Refit: staged weights per update_weights call, in MiB (whole layers; at least one: 0 sends
    one layer per call). Default 512."""
    max_input_len: int | None = Field(None, ge=1)
    """Longest prompt TensorRT-LLM accepts. Default: the run's model.max_seq_len -
    generation.max_new_tokens (engine_from_config), else the model's max_seq_len."""
    max_num_tokens: int | None = Field(None, ge=1)
    """Tokens per scheduler iteration (a prompt's whole prefill must fit). Default: 8192, or
    max_input_len when that is larger."""
    workdir: str | None = None
    """Where config.json of the generation model goes. Default: a fresh temp folder."""
    ray_temp_dir: str | None = None
    """Ray's temp dir (sockets, session logs). Default: a fresh /tmp/sa-ray-* of this engine's own,
    never the node's shared /tmp/ray; keep it short (Ray's socket paths must fit 107 bytes)."""


def vllm_tensor_parallel_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why vLLM cannot shard `heads` attention heads and `kv_heads` key/value heads over `tp`
    ranks (its attention shards whole heads; KV heads are split, or replicated when TP exceeds
    them), or None: the config's check and the engine's (generation/vllm_engine.py)."""
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        return (f"it must divide num_attention_heads={heads} and divide or be a multiple of the key/value heads "
                f"(num_query_groups={kv_heads})")
    return None


def engine_options(model: type[StrictModel], engine: str, options: dict) -> StrictModel:
    """`model(**options)`, with a GenerationError naming the engine, the field, the value and what
    is allowed (an engine made outside a run config, e.g. by a benchmark)."""
    # Deferred: generation imports config.
    from pydantic import ValidationError

    from slurm_align.generation.params import GenerationError

    try:
        return model(**options)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}={err.get('input')!r}: {err['msg']}"
                             for err in e.errors())
        raise GenerationError(f"{engine} engine options: {problems} (allowed fields: "
                              f"{sorted(model.model_fields)})") from None
