"""TensorRT-LLM engine (1.x, PyTorch backend): the weight mapping and the engine's own logic on
CPU for real; the engine itself on GPUs (gpu-marked, run by tests/gpu/run_gpu_checks.sh)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slurm_align.config.run import ModelConfig
from slurm_align.generation import GenerationError, GptShape, SamplingParams, make_engine
from slurm_align.generation.trtllm_engine import (
    TrtllmEngine,
    layer_buckets,
    model_config_of,
    native_stop_ids,
    physical_gpu,
    worker_environ,
)
from slurm_align.generation.trtllm_mapping import hf_config, hf_model_type, hf_weights, trtllm_tp_slice
from slurm_align.models.hf.mapping import read_shard, sources
from slurm_align.models.weights import tp_shard

REPO = Path(__file__).resolve().parents[2]
HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GPU_REASON = ("needs an NVIDIA GPU and TensorRT-LLM 1.2 (NVIDIA container or NVIDIA's index); this machine has "
              + ("no CUDA" if not GPUS else "no tensorrt_llm"))
# Llama/Qwen2 style: GQA (8 heads, 4 groups), SwiGLU, RMSNorm, rope, QKV bias only, tied embeddings.
QWEN = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
                   vocab_size=100, max_seq_len=64, position_embedding="rope", normalization="RMSNorm",
                   activation="swiglu", add_bias_linear=False, add_qkv_bias=True, tie_embeddings=True)
LLAMA = QWEN.model_copy(update=dict(add_qkv_bias=False, tie_embeddings=False, num_query_groups=8))


def megatron_full(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A random full state dict (shared naming) with the shapes megatron gives this config."""
    h, d, heads, groups, f, v = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.query_groups,
                                 cfg.ffn, cfg.padded_vocab_size)
    fc1 = 2 * f if cfg.activation == "swiglu" else f
    shapes = {"word_embeddings.weight": (v, h), "output_layer.weight": (v, h), "layernorm.weight": (h,),
              "layernorm.bias": (h,), "linear_qkv.weight": ((heads + 2 * groups) * d, h),
              "linear_qkv.bias": ((heads + 2 * groups) * d,), "linear_proj.weight": (h, heads * d),
              "linear_proj.bias": (h,), "linear_fc1.weight": (fc1, h), "linear_fc1.bias": (fc1,),
              "linear_fc2.weight": (h, f), "linear_fc2.bias": (h,)}
    g = torch.Generator().manual_seed(seed)
    model_type = hf_model_type(cfg)
    return {name: torch.randn(next(s for k, s in shapes.items() if name.endswith(k)), generator=g)
            for name in sources(cfg, model_type, value_head=False, score_head=False)}


def check_lines_up(full: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """HF tensors as TensorRT-LLM's TP workers slice them hold exactly megatron's TP shards
    (same heads, same gate/up rows), and megatron's shards read back from them, at TP 1, 2, 4."""
    hf = hf_weights(full, cfg)
    model_type = hf_model_type(cfg)
    assert ("lm_head.weight" in hf) == (not cfg.tie_embeddings)
    assert hf["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)  # padding rows cut
    q_rows, d = cfg.num_attention_heads // cfg.query_groups * cfg.head_dim, cfg.head_dim
    table = sources(cfg, model_type, value_head=False, score_head=False)
    for tp in (1, 2, 4):
        g = cfg.query_groups // tp
        for r in range(tp):
            for i in range(cfg.num_layers):
                mg, p = f"decoder.layers.{i}.", f"model.layers.{i}."
                for part in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
                    q, k, v = (trtllm_tp_slice(p + f"self_attn.{x}_proj.{part}", hf[p + f"self_attn.{x}_proj.{part}"],
                                               tp, r) for x in "qkv")
                    tail = q.shape[1:]
                    regrouped = torch.cat([q.reshape(g, q_rows, *tail), k.reshape(g, d, *tail),
                                           v.reshape(g, d, *tail)], 1).reshape(-1, *tail)
                    assert torch.equal(regrouped, tp_shard(full[mg + f"self_attention.linear_qkv.{part}"], 0, tp, r,
                                                           glu=False)), (tp, r, part)
                gate, up = (trtllm_tp_slice(p + f"mlp.{x}_proj.weight", hf[p + f"mlp.{x}_proj.weight"], tp, r)
                            for x in ("gate", "up"))
                assert torch.equal(torch.cat([gate, up]),
                                   tp_shard(full[mg + "mlp.linear_fc1.weight"], 0, tp, r, glu=True))
                for hf_name, mg_name in (("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                                         ("mlp.down_proj.weight", "mlp.linear_fc2.weight")):
                    assert torch.equal(trtllm_tp_slice(p + hf_name, hf[p + hf_name], tp, r),
                                       tp_shard(full[mg + mg_name], 1, tp, r, glu=False))
            # round trip: every megatron TP shard read back from the HF tensors
            for name, src in table.items():
                dim = 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else \
                    0 if ("linear_" in name or "word_embeddings" in name or "output_layer" in name) else None
                glu = name.endswith("linear_fc1.weight")
                want = tp_shard(full[name], dim, tp, r, glu)
                if "word_embeddings" in name or "output_layer" in name:
                    rows = torch.arange(want.shape[0]) + r * want.shape[0] < cfg.vocab_size
                    want = want * rows.unsqueeze(1)  # padding rows come back as zeros
                got = read_shard(src, cfg, model_type,
                                 lambda n, dm, a, b: hf[n] if dm is None else hf[n].narrow(dm, a, b - a),
                                 tuple(want.shape), dim, tp, r)
                assert torch.equal(got, want), (name, tp, r)


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen2-gqa-qkvbias-tied", "llama-mha-untied"])
def test_mapping_lines_up_with_megatron_tp_shards(cfg):
    check_lines_up(megatron_full(cfg, 0), cfg)


def test_mapping_on_real_megatron_weights(tmp_path):
    """build_gpt's real full state dict (Qwen2 style) maps with every name accounted for."""
    code = ("import torch\n"
            "from slurm_align.parallel.bootstrap import init_distributed\n"
            "from slurm_align.parallel.layout import initialize_model_parallel\n"
            "from slurm_align.models.gpt import build_gpt\n"
            "from slurm_align.models.weights import full_state_dict\n"
            "from tests.integration.test_generation_trtllm import QWEN\n"
            "pctx = initialize_model_parallel(init_distributed(), 1, 1)\n"
            f"torch.save(full_state_dict(build_gpt(QWEN, pctx, seed=4), pctx), {str(tmp_path / 'full.pt')!r})\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = torch.load(tmp_path / "full.pt")
    assert "output_layer.weight" not in full  # tied
    check_lines_up(full, QWEN)


def test_hf_config_names_the_pytorch_backend_architecture():
    assert hf_config(QWEN)["architectures"] == ["Qwen2ForCausalLM"]
    c = hf_config(LLAMA)
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == 8 and c["vocab_size"] == 100


def test_gpt2_style_models_are_refused_with_the_alternative():
    with pytest.raises(GenerationError, match=r"no model for this architecture.*generation\.engine 'torch'"):
        hf_model_type(ModelConfig())
    with pytest.raises(GenerationError, match="no model for this architecture"):
        hf_weights({}, ModelConfig(activation="gelu_tanh", tie_embeddings=True))
    with pytest.raises(GenerationError, match="missing"):
        hf_weights({}, QWEN)
    with pytest.raises(GenerationError, match="not a tensor-parallel linear"):
        trtllm_tp_slice("model.norm.weight", torch.ones(4), 2, 0)


def test_engine_options_and_missing_gpu_are_clear_errors():
    shape = GptShape.from_model_config(QWEN)
    with pytest.raises(GenerationError, match=r"dtype='float32'.*bfloat16"):
        make_engine("trtllm", shape, dtype="float32")
    with pytest.raises(GenerationError, match=r"allowed.*kv_cache_fraction"):
        make_engine("trtllm", shape, kv_cach_fraction=0.5)
    with pytest.raises(GenerationError, match="no model for this architecture"):
        make_engine("trtllm", ModelConfig())  # slurm-align's GPT: refused when the engine is made
    engine = make_engine("trtllm", QWEN)  # constructing imports nothing
    assert engine.options.dtype == "bfloat16" and engine.tp_size == 1
    if not GPUS:
        with pytest.raises(GenerationError, match="needs a CUDA GPU"):
            engine.refit(megatron_full(QWEN, 0))
    with pytest.raises(GenerationError, match="refit"):
        engine.generate([torch.tensor([1, 2])], SamplingParams())
    layout = SimpleNamespace(tp_size=2, pp_size=2, mp_comm=None)
    with pytest.raises(GenerationError, match="refold"):
        TrtllmEngine.for_layout(QWEN, layout)


def test_model_config_from_a_shape_keeps_its_fields():
    shape = GptShape.from_model_config(LLAMA)
    cfg = model_config_of(shape)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn, cfg.vocab_size, cfg.padded_vocab_size) == \
        (LLAMA.num_layers, LLAMA.hidden_size, LLAMA.ffn, LLAMA.vocab_size, LLAMA.padded_vocab_size)
    for f in ("position_embedding", "normalization", "activation", "num_query_groups", "add_qkv_bias",
              "tie_embeddings"):
        if hasattr(shape, f):  # a GptShape with the architecture fields keeps them
            assert getattr(cfg, f) == getattr(LLAMA, f), f
    assert model_config_of(QWEN) is QWEN


def test_refit_buckets_hold_whole_layers():
    hf = hf_weights(megatron_full(QWEN, 1), QWEN)
    nbytes = {k: v.numel() * 2 for k, v in hf.items()}
    layer0 = sum(b for k, b in nbytes.items() if k.startswith("model.layers.0."))
    buckets = layer_buckets(list(hf), nbytes, budget=layer0)
    assert sorted(n for b in buckets for n in b) == sorted(hf)
    for b in buckets:
        layers = {n.split(".")[2] for n in b if n.startswith("model.layers.")}
        assert len(layers) <= 1 or sum(nbytes[n] for n in b) <= layer0, b
        for i in layers:  # a layer is never split across buckets
            assert all(n in b for n in hf if n.startswith(f"model.layers.{i}."))
    assert len(layer_buckets(list(hf), nbytes, budget=1 << 40)) == 1


def test_ray_workers_get_the_replicas_gpus_and_no_launcher_variables(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # e.g. Slurm's binding for this task
    monkeypatch.setenv("PMIX_RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("KEEP_ME", "1")
    assert [physical_gpu(0), physical_gpu(1)] == ["4", "6"]
    with worker_environ(["6", "7"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7" and os.environ["KEEP_ME"] == "1"
        assert not {"PMIX_RANK", "SLURM_PROCID", "MASTER_PORT"} & set(os.environ)
        os.environ["TLLM_DISABLE_MPI"] = "1"  # set by TensorRT-LLM while the LLM is made
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6" and os.environ["PMIX_RANK"] == "3"
    assert os.environ.pop("TLLM_DISABLE_MPI") == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu(1) == "1"


def _result(ids, reason, logprobs=None, stop_reason=None):
    """A RequestOutput with one CompletionOutput (tests/fixtures/gpu_api.json lists its fields)."""
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason, logprobs=logprobs,
                                                    stop_reason=stop_reason)])


def test_outputs_lengths_eos_and_logprobs_from_completion_outputs():
    engine = TrtllmEngine(QWEN, "cpu")
    params = SamplingParams(max_new_tokens=4, eos_id=9, pad_id=0)
    lp = lambda ids: [{t: SimpleNamespace(logprob=-0.5 * (j + 1), rank=1)} for j, t in enumerate(ids)]  # noqa: E731
    out = engine._collect([_result([5, 9], "stop", lp([5, 9])), _result([1, 2, 3, 4], "length", lp([1, 2, 3, 4]))],
                          params, want_lp=True)
    assert out.response_tokens.tolist() == [[5, 9, 0, 0], [1, 2, 3, 4]]
    assert out.response_lengths.tolist() == [2, 4] and out.is_end.tolist() == [True, False]
    assert out.logprobs.tolist() == [[-0.5, -1.0, 0.0, 0.0], [-0.5, -1.0, -1.5, -2.0]]
    # a stop token left out of token_ids is put back (length counts it); log-probs then unknown
    out = engine._collect([_result([5], "stop", lp([5]))], params, want_lp=True)
    assert out.response_tokens.tolist() == [[5, 9]] and out.is_end.tolist() == [True] and out.logprobs is None
    out = engine._collect([_result([7, 7], "length")], SamplingParams(max_new_tokens=2), want_lp=False)
    assert out.is_end.tolist() == [False] and out.logprobs is None


def test_one_token_stop_sequences_stop_inside_the_engine_and_longer_ones_are_cut_after():
    """Multi-turn stops: TensorRT-LLM ends a sample at EOS and at each one-token stop sequence
    (stop_token_ids: Qwen's </tool_call> is one token); a longer one it cannot take as token ids,
    so the multi-turn loop cuts the turn after it (conversations.stop_cut)."""
    engine = TrtllmEngine(QWEN, "cpu")
    params = SamplingParams(max_new_tokens=4, eos_id=9, pad_id=0, stop_token_sequences=((42,), (1, 2), (9,)))
    assert native_stop_ids(params) == [9, 42]
    assert native_stop_ids(SamplingParams(max_new_tokens=4, stop_token_sequences=((42,),))) == [42]
    out = engine._collect([_result([5, 42], "stop", stop_reason=42), _result([5], "stop", stop_reason=42),
                           _result([1, 2, 3, 4], "length")], params, want_lp=False)
    assert out.response_tokens.tolist() == [[5, 42, 0, 0], [5, 42, 0, 0], [1, 2, 3, 4]]
    assert out.is_end.tolist() == [True, True, False]


def _gpu_worker(n: int, *args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {k: v for k, v in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    cmd = ["mpirun", "--oversubscribe", "-n", str(n), sys.executable, "-W", "ignore", "tests/gpu/trtllm_worker.py",
           *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.mpi  # ranks under mpirun
@pytest.mark.skipif(not (HAVE_TRTLLM and GPUS), reason=GPU_REASON)
def test_trtllm_engine_on_a_real_megatron_model():
    """Megatron model on CUDA -> refit in place -> greedy tokens as the torch engine's, EOS
    reached and counted, bf16 default, free and reload (tests/gpu/trtllm_worker.py says how)."""
    proc = _gpu_worker(1, "1")
    assert proc.returncode == 0 and "TRTLLM_OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.mpi  # ranks under mpirun
@pytest.mark.skipif(not (HAVE_TRTLLM and GPUS), reason=GPU_REASON)
@pytest.mark.skipif(GPUS < 2, reason=f"TensorRT-LLM at TP=2 needs 2 GPUs; this machine has {GPUS}")
def test_trtllm_engine_tensor_parallel_2():
    proc = _gpu_worker(2, "2")
    assert proc.returncode == 0 and proc.stdout.count("TRTLLM_OK") == 2, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not GPUS, reason="needs a CUDA GPU; this machine has none")
def test_kv_engine_on_gpu_equals_cpu():
    shape = GptShape(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                     vocab_size=100, padded_vocab_size=128, max_seq_len=40)
    from slurm_align.generation.weights import expected_shapes
    g = torch.Generator().manual_seed(3)
    w = {k: torch.randn(s, generator=g) * 0.1 for k, s in expected_shapes(shape).items()}
    prompts = [torch.randint(0, shape.vocab_size, (n,), generator=g) for n in (3, 9, 5)]
    cpu, gpu = make_engine("torch", shape), make_engine("torch", shape, device="cuda")
    cpu.refit(w)
    gpu.refit(w)
    p = SamplingParams(max_new_tokens=8, temperature=0.0)
    a, b = cpu.generate(prompts, p), gpu.generate(prompts, p)
    assert torch.equal(a.response_tokens, b.response_tokens)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-3
