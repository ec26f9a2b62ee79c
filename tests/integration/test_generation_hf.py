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

WORKER = Path(__file__).parents[1] / "programs" / "arch_generation_worker.py"
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
    with pytest.raises(GenerationError, match=r"missing.*linear_qkv\.bias"):
        make_engine("naive", llama).refit(sd)


# --- 2. imported Hugging Face models against transformers' generate -------------------------
HF_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=250,
                max_position_embeddings=128, bos_token_id=None, eos_token_id=None, initializer_range=0.3)


def make_hf_models(root: Path) -> dict[str, Path]:
    """Tiny random models (large init: peaked logits, greedy far from ties), saved as a Hub
    folder is: config.json + safetensors."""
    t = pytest.importorskip("transformers")
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    models = {
        "llama": t.LlamaForCausalLM(t.LlamaConfig(**HF_SHAPE, num_attention_heads=8, num_key_value_heads=2,
                                                  rope_parameters=llama3)),
        "qwen2": t.Qwen2ForCausalLM(t.Qwen2Config(**HF_SHAPE, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=True)),
        "mistral": t.MistralForCausalLM(t.MistralConfig(**HF_SHAPE, num_attention_heads=4, num_key_value_heads=1,
                                                        head_dim=24, sliding_window=None)),
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=250, n_positions=128,
                                               bos_token_id=None, eos_token_id=None, initializer_range=0.3)),
    }
    out = {}
    g = torch.Generator().manual_seed(7)
    for name, model in models.items():
        with torch.no_grad():   # norms and biases away from 1 and 0, as a trained model's
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        out[name] = root / name
        model.save_pretrained(out[name])
    return out


def assert_generates_as_transformers(folders: list[Path], tmp_path: Path) -> None:
    """Both torch engines (tests/programs/arch_generation_worker.py), refitted from each imported HF folder,
    reproduce transformers' greedy generate token for token on four prompts of ids below 250."""
    t = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(5)
    prm = [torch.randint(0, 250, (n,), generator=g) for n in (6, 1, 11, 3)]
    out = tmp_path / "out"
    out.mkdir()
    torch.save(prm, out / "prompts.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(WORKER), str(out), "--hf", *map(str, folders)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for folder in folders:
        name = folder.name
        ours = torch.load(out / f"{name}.pt")
        model = t.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for i, p in enumerate(prm):
            with torch.no_grad():
                want = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                      do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
            want = want[0, p.numel():]
            assert torch.equal(ours["greedy"][i], want), f"{name} prompt {i}: {ours['greedy'][i]} != {want}"
            assert torch.equal(ours["naive"][i], want), f"{name} prompt {i} (naive)"


def test_imported_models_generate_as_transformers(tmp_path: Path):
    pytest.importorskip("transformers")
    folders = make_hf_models(tmp_path / "models")
    assert_generates_as_transformers(list(folders.values()), tmp_path)
