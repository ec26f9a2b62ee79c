"""TensorRT-LLM generation engine (extra `trtllm`, NVIDIA GPUs only).

Targets TensorRT-LLM 0.16.0's TensorRT-engine Python API (`tensorrt_llm.build`, `BuildConfig`,
`models.GPTConfig` / `GPTForCausalLM`, `runtime.ModelRunner.from_engine`, `SamplingConfig`) and
TensorRT's `trt.Refitter`; the path NeMo-Aligner used (../shared/TRTLLM.md, part A), without the
NeMo exporter: our megatron weights go through trtllm_mapping.py. Written against the API on
paper: no GPU was available to run it (see the gpu-marked tests).

- first refit: convert the full state dict to this rank's TP shard, build an engine with the
  refit flag (`use_refit=True`), load it with ModelRunner.from_engine;
- later refits: convert again and push every named weight through one trt.Refitter; a weight
  the engine has and we do not supply (or vice versa) is an error, not a warning;
- generate: unpadded 1-D prompts; per-sample seeds as SamplingConfig.random_seed (one int64 per
  row); EOS handling as NeMo-Aligner does it: end_id/pad_id are a sentinel that never occurs and
  EOS is a stop word, so the returned length includes the EOS and is_end = last token is EOS;
- layout: one engine per generation-DP replica in the refolded layout (DP_gen = DP x PP, TP
  kept); the MPI communicator handed to TensorRT-LLM must span exactly this replica's TP ranks
  (GenerationLayout.mp_comm), and the engine's TP rank is layout.tp_rank.

Numerics: TensorRT-LLM's "gelu" is the tanh approximation, so logits differ slightly from the
training model's exact-erf GELU; policy log-probs for the loss are recomputed by the training
forward anyway (GenerationOutput.logprobs is None here).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from typing import Any, Sequence

import torch

from slurm_align.generation.base import pack_prompts
from slurm_align.generation.params import GenerationError, GenerationOutput, GptShape, SamplingParams
from slurm_align.generation.trtllm_mapping import megatron_to_trtllm
from slurm_align.generation.weights import check_state_dict

PINNED_VERSION = "0.16.0"
_SENTINEL = -42  # end_id/pad_id: never a real token, so only the EOS stop word ends a sample


def import_tensorrt_llm() -> Any:
    """Import tensorrt_llm only when the engine is used, with a clear message when missing."""
    try:
        trtllm = importlib.import_module("tensorrt_llm")
    except ImportError as e:
        raise GenerationError(
            f"generation engine 'trtllm' needs TensorRT-LLM {PINNED_VERSION} and an NVIDIA GPU: "
            f"install the extra (`pip install slurm-align[trtllm]` from NVIDIA's index, or use an "
            f"NVIDIA container), or choose generation.engine 'torch' ({e})") from e
    if not torch.cuda.is_available():
        raise GenerationError("generation engine 'trtllm' needs a CUDA GPU; choose generation.engine 'torch'")
    return trtllm


class TrtllmEngine:
    def __init__(self, shape: GptShape, *, tp_size: int = 1, tp_rank: int = 0, max_batch_size: int = 64,
                 max_input_len: int | None = None, dtype: str = "float16", workdir: str | None = None):
        self.shape = shape
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.max_batch_size = max_batch_size
        self.max_input_len = max_input_len or shape.max_seq_len // 2
        self.dtype = dtype
        self.torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        self.workdir = workdir or tempfile.mkdtemp(prefix="slurm_align_trtllm_")
        self._trt = None
        self._runner = None

    @classmethod
    def for_layout(cls, shape: GptShape, layout: Any, **kwargs) -> "TrtllmEngine":
        """One engine per generation replica of a GenerationLayout (refolded or not): with TP > 1
        TensorRT-LLM's own MPI world is split so that it spans exactly this replica's TP ranks
        (as NeMo's exporter does; global ranks are TP-contiguous in megatron's order)."""
        import_tensorrt_llm()
        if layout.pp_size != 1:
            raise GenerationError("TrtllmEngine: generate with refold on (pipeline stages refolded into DP)")
        if layout.tp_size > 1:
            from tensorrt_llm.bindings import MpiComm
            MpiComm.split(layout.dp_rank, layout.tp_rank)
        return cls(shape, tp_size=layout.tp_size, tp_rank=layout.tp_rank, **kwargs)

    # -- building and refitting ------------------------------------------------------------
    def _convert(self, full_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_state_dict(full_state_dict, self.shape)
        return megatron_to_trtllm(full_state_dict, self.shape, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                  dtype=self.torch_dtype)

    def _build(self, weights: dict[str, torch.Tensor]) -> None:
        trtllm = import_tensorrt_llm()
        from tensorrt_llm import BuildConfig, Mapping
        from tensorrt_llm._utils import torch_to_numpy
        from tensorrt_llm.models import GPTConfig, GPTForCausalLM
        from tensorrt_llm.runtime import ModelRunner

        s = self.shape
        config = GPTConfig(
            architecture="GPTForCausalLM", dtype=self.dtype, num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_attention_heads, hidden_size=s.hidden_size,
            intermediate_size=s.ffn_hidden_size, vocab_size=s.vocab_size, hidden_act="gelu",
            position_embedding_type="learned_absolute", max_position_embeddings=s.max_seq_len,
            norm_epsilon=s.layernorm_epsilon, bias=True, use_parallel_embedding=False,
            mapping=Mapping(world_size=self.tp_size, rank=self.tp_rank, tp_size=self.tp_size, pp_size=1),
        )
        model = GPTForCausalLM(config)
        model.load({k: torch_to_numpy(v.cpu()) for k, v in weights.items()})
        build_config = BuildConfig(
            max_batch_size=self.max_batch_size, max_input_len=self.max_input_len,
            max_seq_len=s.max_seq_len, max_beam_width=1, use_refit=True,
            gather_context_logits=False, gather_generation_logits=False)
        engine = trtllm.build(model, build_config)
        engine.save(os.path.join(self.workdir, f"tp{self.tp_rank}"))  # reload point after free()
        self._runner = ModelRunner.from_engine(
            engine, max_output_len=None, lora_dir=None, rank=torch.cuda.current_device(),
            debug_mode=False, lora_ckpt_source="hf", medusa_choices=None, stream=None,
            gpu_weights_percent=1.0, enable_context_fmha_fp32_acc=None, multi_block_mode=None)

    def _refit_in_place(self, weights: dict[str, torch.Tensor]) -> None:
        import tensorrt as trt

        engine = self._runner.session.runtime.engine
        refitter = trt.Refitter(engine, trt.Logger(trt.Logger.WARNING))
        wanted = set(refitter.get_all_weights())
        missing, extra = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
        if missing:
            raise GenerationError(f"TensorRT-LLM refit: engine weights without a source: {missing[:5]}")
        trt_dtype = {torch.float16: trt.float16, torch.bfloat16: trt.bfloat16, torch.float32: trt.float32}[self.torch_dtype]
        on_device = {k: weights[k].to("cuda", non_blocking=True).contiguous() for k in wanted}
        torch.cuda.synchronize()
        for name, t in on_device.items():  # `on_device` keeps the memory alive until the refit
            refitter.set_named_weights(name, trt.Weights(trt_dtype, t.data_ptr(), t.numel()),
                                       trt.TensorLocation.DEVICE)
        if not refitter.refit_cuda_engine():
            raise GenerationError("TensorRT-LLM refit: refit_cuda_engine() returned False")
        del extra  # names only the checkpoint has (none for this architecture) are ignored

    def refit(self, full_state_dict: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        weights = self._convert(full_state_dict)
        if self._runner is None:
            saved = os.path.join(self.workdir, f"tp{self.tp_rank}")
            if os.path.isdir(saved):  # freed earlier: reload the engine, then refit it
                from tensorrt_llm.runtime import ModelRunner
                import_tensorrt_llm()
                self._runner = ModelRunner.from_dir(saved, rank=torch.cuda.current_device())
                self._refit_in_place(weights)
            else:
                self._build(weights)
        else:
            self._refit_in_place(weights)
        return time.perf_counter() - t0

    def free(self) -> None:
        """Drop the runner (engine + KV cache); the next refit reloads the saved engine."""
        self._runner = None
        torch.cuda.empty_cache()

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams,
                 seeds: Sequence[int] | torch.Tensor | None = None) -> GenerationOutput:
        if self._runner is None:
            raise GenerationError("TrtllmEngine: no engine; call refit(full_state_dict) first")
        from tensorrt_llm.runtime import SamplingConfig

        batch = pack_prompts(prompts, self.shape, params, seeds, torch.device("cpu"))
        cfg = SamplingConfig(
            end_id=_SENTINEL, pad_id=_SENTINEL, max_new_tokens=params.max_new_tokens, num_beams=1,
            temperature=1.0 if params.greedy else params.temperature,
            top_k=1 if params.greedy else params.top_k, top_p=0.0 if params.greedy else params.top_p,
            stop_words_list=None if params.eos_id is None else [[[params.eos_id]]] * len(prompts),
            return_dict=True, output_sequence_lengths=True)
        cfg.update(random_seed=batch.seeds.clone())
        out = self._runner.generate([p.reshape(-1).to(torch.int32).cpu() for p in prompts], sampling_config=cfg)
        ids, seq_len = out["output_ids"][:, 0].cpu(), out["sequence_lengths"][:, 0].cpu()
        lengths = batch.lengths.cpu()
        n = len(prompts)
        tokens = torch.full((n, params.max_new_tokens), params.pad_id, dtype=torch.int64)
        resp_len = (seq_len.long() - lengths).clamp_(0, params.max_new_tokens)
        for i in range(n):  # once per call, not per token
            r = ids[i, int(lengths[i]): int(lengths[i]) + int(resp_len[i])].long()
            tokens[i, : r.numel()] = r.clamp_(0, self.shape.vocab_size - 1)
        last = tokens.gather(1, (resp_len - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        is_end = (resp_len > 0) & (last == params.eos_id) if params.eos_id is not None else torch.zeros(n, dtype=torch.bool)
        width = int(resp_len.max()) if n else 0
        return GenerationOutput(tokens[:, :width], resp_len, is_end, None)
