"""The torch engines on Llama / Qwen2 / Mistral / GPT-2 architectures.

1. Against the training model: megatron-core GPTModel built by build_gpt with the architecture
   fields (GQA, RoPE with Llama-3 scaling, RMSNorm, SwiGLU, QKV bias, tied output, tanh GELU,
   kv_channels); the engines are refitted from it (arch_generation_worker.py, one process).
2. Against transformers: tiny models made here (random init, save_pretrained), imported through
   model.hf_path, generate greedily token for token as transformers' generate(do_sample=False).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
from slurm_align.generation.weights import expected_shapes

WORKER = Path(__file__).with_name("arch_generation_worker.py")
ARCHS = ("llama", "qwen2", "gpt2")


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("arch")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(WORKER), str(out), *ARCHS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: torch.load(out / f"{name}.pt") for name in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_engines_equal_megatron_forward(megatron_runs, arch: str):
    r = megatron_runs[arch]
    assert bool((r["ref_arg"] >= 0).all()), "every greedy response should run to max_new_tokens here"
    # Greedy tokens are the training forward's argmax at every position; log-probs within 1e-4.
    assert torch.equal(r["greedy"], r["ref_arg"])
    assert torch.equal(r["naive"], r["greedy"])
    assert (r["greedy_lp"] - r["ref_lp"]).abs().max() < 1e-4
    assert (r["naive_lp"] - r["ref_lp"]).abs().max() < 1e-4
    # Seeded sampling: both engines draw the same samples; the draws are not the greedy ones.
    assert torch.equal(r["sampled"], r["naive_sampled"])
    assert not torch.equal(r["sampled"], r["greedy"])


def test_gqa_cache_holds_query_groups_heads(megatron_runs):
    assert megatron_runs["llama"]["kv_heads_cached"] == 2    # 8 attention heads, 2 groups
    assert megatron_runs["qwen2"]["kv_heads_cached"] == 2
    assert megatron_runs["gpt2"]["kv_heads_cached"] == 4     # no GQA: one per head


def test_state_dict_names_follow_the_architecture():
    llama = GptShape(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=60,
                     padded_vocab_size=64, max_seq_len=16, position_embedding="rope", normalization="RMSNorm",
                     activation="swiglu", num_query_groups=2, kv_channels=12, add_bias_linear=False,
                     add_qkv_bias=True, tie_embeddings=True)
    want = expected_shapes(llama)
    assert want["decoder.layers.0.self_attention.linear_qkv.weight"] == ((4 + 2 * 2) * 12, 32)
    assert want["decoder.layers.0.self_attention.linear_qkv.bias"] == ((4 + 2 * 2) * 12,)
    assert want["decoder.layers.0.self_attention.linear_proj.weight"] == (32, 48)
    assert want["decoder.layers.0.mlp.linear_fc1.weight"] == (96, 32)   # [gate; up]
    for absent in ("output_layer.weight", "embedding.position_embeddings.weight", "decoder.final_layernorm.bias",
                   "decoder.layers.0.input_layernorm.bias", "decoder.layers.0.mlp.linear_fc1.bias",
                   "decoder.layers.0.self_attention.linear_proj.bias"):
        assert absent not in want
    engine = make_engine("torch", llama)
    sd = {k: torch.randn(s) for k, s in want.items()}
    engine.refit({**sd, "output_layer.weight": sd["embedding.word_embeddings.weight"]})  # a tied copy is ignored
    out = engine.generate([torch.tensor([1, 2, 3])], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert out.response_lengths.tolist() == [4]
    sd.pop("decoder.layers.0.self_attention.linear_qkv.bias")
    with pytest.raises(GenerationError, match="missing.*linear_qkv.bias"):
        make_engine("naive", llama).refit(sd)
