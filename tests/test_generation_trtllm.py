"""TensorRT-LLM engine: the pure-python weight mapping on CPU (for real), the engine on GPUs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
from slurm_align.generation.trtllm_mapping import (lm_head_rows, mcore_name, megatron_to_trtllm,
                                                   trtllm_name, trtllm_to_megatron)
from slurm_align.generation.weights import expected_shapes

SHAPE = GptShape(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                 vocab_size=100, padded_vocab_size=128, max_seq_len=40)
HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
GPU_REASON = "needs an NVIDIA GPU and TensorRT-LLM (extra `trtllm`); this machine has " + \
    ("no CUDA" if not torch.cuda.is_available() else "no tensorrt_llm")


def random_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in expected_shapes(SHAPE).items()}


def check_mapping(full: dict[str, torch.Tensor], shape: GptShape) -> None:
    """Names, shapes, the QKV semantics and the round trip for TP 1, 2, 4."""
    h, d, heads = shape.hidden_size, shape.head_dim, shape.num_attention_heads
    for tp in (1, 2, 4):
        shards = [megatron_to_trtllm(full, shape, tp_size=tp, tp_rank=r) for r in range(tp)]
        s0 = shards[0]
        assert set(s0) == {trtllm_name(k) for k in full}
        assert all(mcore_name(trtllm_name(k)) == k for k in full)
        assert s0["transformer.layers.0.attention.qkv.weight"].shape == (3 * h // tp, h)
        assert s0["transformer.layers.0.attention.dense.weight"].shape == (h, h // tp)
        assert s0["transformer.layers.0.mlp.fc.weight"].shape == (shape.ffn_hidden_size // tp, h)
        assert s0["transformer.vocab_embedding.weight"].shape == (shape.vocab_size, h)
        assert s0["lm_head.weight"].shape == (lm_head_rows(shape, tp) // tp, h)
        back = trtllm_to_megatron(shards, shape)
        for k, t in full.items():
            rows = shape.vocab_size if k in ("embedding.word_embeddings.weight", "output_layer.weight") else None
            assert torch.equal(back[k][:rows], t[:rows]), k
    # QKV semantics: TRT-LLM's [Q; K; V] rows give the same per-head q/k/v as megatron's grouping.
    x = torch.randn(5, h)
    qkv_w = full["decoder.layers.1.self_attention.linear_qkv.weight"]
    qkv_b = full["decoder.layers.1.self_attention.linear_qkv.bias"]
    mix = F.linear(x, qkv_w, qkv_b).view(5, heads, 3 * d)  # megatron: [ng, (q, k, v) * d]
    t = megatron_to_trtllm(full, shape)
    ours = F.linear(x, t["transformer.layers.1.attention.qkv.weight"], t["transformer.layers.1.attention.qkv.bias"])
    q, k, v = ours.split(h, dim=-1)
    assert torch.allclose(q.view(5, heads, d), mix[..., :d])
    assert torch.allclose(k.view(5, heads, d), mix[..., d:2 * d])
    assert torch.allclose(v.view(5, heads, d), mix[..., 2 * d:])


def test_mapping_names_shapes_qkv_round_trip():
    check_mapping(random_weights(0), SHAPE)


def test_mapping_rejects_bad_input():
    with pytest.raises(GenerationError, match="no TensorRT-LLM name"):
        trtllm_name("decoder.layers.0.self_attention.q_layernorm.weight")
    with pytest.raises(GenerationError, match="must divide"):
        megatron_to_trtllm(random_weights(0), SHAPE, tp_size=3)


@pytest.mark.skipif(HAVE_TRTLLM, reason="tensorrt_llm is installed here")
def test_missing_tensorrt_llm_is_a_clear_error():
    engine = make_engine("trtllm", SHAPE)  # constructing imports nothing
    with pytest.raises(GenerationError, match="TensorRT-LLM 0.16.0 and an NVIDIA GPU"):
        engine.refit(random_weights(0))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_TRTLLM and torch.cuda.is_available()), reason=GPU_REASON)
def test_trtllm_engine_builds_refits_and_matches_torch_engine():
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,)) for n in (3, 9, 5)]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    trt_engine = make_engine("trtllm", SHAPE, dtype="float32")
    ref = make_engine("torch", SHAPE, device="cuda")
    for seed in (0, 1):  # first refit builds, the second refits in place
        w = {k: v * 0.1 for k, v in random_weights(seed).items()}
        trt_engine.refit(w)
        ref.refit(w)
        a, b = trt_engine.generate(prompts, greedy), ref.generate(prompts, greedy)
        assert torch.equal(a.response_lengths, b.response_lengths)
        agree = (a.response_tokens == b.response_tokens).float().mean()
        assert agree > 0.9  # tanh-GELU vs erf-GELU may flip a near tie
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, eos_id=7)
    full = trt_engine.generate(prompts, sampled, [5, 6, 7])
    one = trt_engine.generate(prompts[1:2], sampled, [6])
    assert torch.equal(full.responses()[1], one.responses()[0])
    ended = full.is_end.nonzero().flatten().tolist()
    assert all(int(full.responses()[i][-1]) == 7 for i in ended)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")
def test_kv_engine_on_gpu_equals_cpu():
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,)) for n in (3, 9, 5)]
    w = {k: v * 0.1 for k, v in random_weights(3).items()}
    cpu, gpu = make_engine("torch", SHAPE), make_engine("torch", SHAPE, device="cuda")
    cpu.refit(w)
    gpu.refit(w)
    p = SamplingParams(max_new_tokens=8, temperature=0.0)
    a, b = cpu.generate(prompts, p), gpu.generate(prompts, p)
    assert torch.equal(a.response_tokens, b.response_tokens)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-3
