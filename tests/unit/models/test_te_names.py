"""A model named by the Transformer Engine layer spec: init, full_state_dict, load and engine
binding see the local spec's names (models/te_names.py), without TE installed.

The TE-spec parameter names are written out here as megatron-core 0.16.1 names them
(TELayerNormColumnParallelLinear carries the pre-norms of attention and MLP), not derived from
te_names, so the table itself is under test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slurm_align.generation import GptShape, SamplingParams, make_engine
from slurm_align.generation.weights import expected_shapes
from slurm_align.models.te_names import local_name, local_names, te_name
from slurm_align.models.weights import full_state_dict, init_weights, load_full_state_dict

SHAPE = GptShape(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                 vocab_size=50, padded_vocab_size=64, max_seq_len=24)
PCTX = SimpleNamespace(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
REPO = Path(__file__).resolve().parents[3]


def te_spec_names(shape: GptShape) -> dict[str, tuple[int, ...]]:
    h, f, v = shape.hidden_size, shape.ffn_hidden_size, shape.padded_vocab_size
    out = {"embedding.word_embeddings.weight": (v, h), "embedding.position_embeddings.weight": (shape.max_seq_len, h)}
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        out.update({
            p + "self_attention.linear_qkv.layer_norm_weight": (h,),
            p + "self_attention.linear_qkv.layer_norm_bias": (h,),
            p + "self_attention.linear_qkv.weight": (3 * h, h), p + "self_attention.linear_qkv.bias": (3 * h,),
            p + "self_attention.linear_proj.weight": (h, h), p + "self_attention.linear_proj.bias": (h,),
            p + "mlp.linear_fc1.layer_norm_weight": (h,), p + "mlp.linear_fc1.layer_norm_bias": (h,),
            p + "mlp.linear_fc1.weight": (f, h), p + "mlp.linear_fc1.bias": (f,),
            p + "mlp.linear_fc2.weight": (h, f), p + "mlp.linear_fc2.bias": (h,),
        })
    out.update({"decoder.final_layernorm.weight": (h,), "decoder.final_layernorm.bias": (h,),
                "output_layer.weight": (v, h)})
    return out


def tree_model(names: dict[str, tuple[int, ...]]) -> torch.nn.Module:
    """A module whose state_dict has exactly these names (the parameters a spec would create)."""
    root = torch.nn.Module()
    for name, shape in names.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, 7.0)))
    root.config = SimpleNamespace(init_method_std=0.02, num_layers=SHAPE.num_layers, gated_linear_unit=False)
    return root


def test_name_table_both_ways():
    te = te_spec_names(SHAPE)
    assert {local_name(k) for k in te} == set(expected_shapes(SHAPE))
    assert all(te_name(local_name(k)) == k for k in te)
    qkv = "decoder.layers.3.self_attention.linear_qkv.weight"
    assert local_name(qkv) == qkv


def test_te_named_model_init_state_dict_load_and_engine_binding():
    te_model, local_model = tree_model(te_spec_names(SHAPE)), tree_model(expected_shapes(SHAPE))
    init_weights([te_model], PCTX, seed=3)
    init_weights([local_model], PCTX, seed=3)
    te_sd = te_model.state_dict()
    # init: fused norms are (1, 0), not left at the 7.0 they were created with nor drawn at random
    for k, t in te_sd.items():
        if k.endswith("layer_norm_weight"):
            assert torch.equal(t, torch.ones_like(t)), k
        elif k.endswith("layer_norm_bias"):
            assert torch.equal(t, torch.zeros_like(t)), k
    # same seed, same weights as the local-spec model, name for name
    full = full_state_dict([te_model], PCTX)
    assert list(full) == [local_name(k) for k in te_sd]
    ref = full_state_dict([local_model], PCTX)
    assert set(full) == set(ref) and all(torch.equal(full[k], ref[k]) for k in ref)
    # load: a full dict in the shared naming lands in the TE-named parameters
    g = torch.Generator().manual_seed(0)
    new = {k: torch.randn(t.shape, generator=g) for k, t in full.items()}
    load_full_state_dict([te_model], PCTX, new)
    assert torch.equal(te_model.state_dict()["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       new["decoder.layers.1.pre_mlp_layernorm.weight"])
    # engine binding: the TE-named dict itself (as a checkpoint would hold it) binds the norms
    te_sd = te_model.state_dict()
    engine = make_engine("torch", SHAPE)
    engine.refit(te_sd)
    layer = engine.weights.layers[1]
    assert torch.equal(layer.ln1_w, te_sd["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"])
    assert torch.equal(layer.ln2_b, te_sd["decoder.layers.1.mlp.linear_fc1.layer_norm_bias"])
    out = engine.generate([torch.tensor([1, 2, 3])], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert out.response_lengths.tolist() == [3]
    assert set(local_names(te_sd)) == set(expected_shapes(SHAPE))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("transformer_engine")),
                    reason="needs a CUDA GPU and Transformer Engine (extra `te`); this machine has "
                           + ("no CUDA" if not torch.cuda.is_available() else "no transformer_engine"))
def test_te_spec_model_equals_local_spec_model_on_gpu():
    """Built with the TE spec and with the local spec, same seed: same full state dict, same logits."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "tests/gpu/te_spec_worker.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("TE_SPEC_OK") == 2, proc.stdout[-3000:] + proc.stderr[-3000:]


# --- which layer spec, with which arguments (recording stand-ins for megatron's spec builders) ---
DENSE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 200, "max_seq_len": 32}


@pytest.fixture
def specs(monkeypatch):
    """megatron's two spec builders replaced by recorders; CUDA and TE reported present."""
    from slurm_align.models import gpt

    calls = []
    for name, kind in (("get_gpt_layer_local_spec", "local"), ("get_gpt_layer_with_transformer_engine_spec", "te")):
        monkeypatch.setattr(gpt, name, lambda *args, _kind=kind, **kwargs: calls.append((_kind, args, kwargs)) or _kind)
    monkeypatch.setattr(gpt, "cuda_present", lambda: True)
    monkeypatch.setattr(gpt, "te_importable", lambda: True)
    return gpt, calls


@pytest.mark.parametrize("moe", [None, 4], ids=["dense", "moe"])
def test_each_spec_gets_the_models_experts_and_qk_norm_by_name(specs, moe):
    from slurm_align.config.run import ModelConfig

    gpt, calls = specs
    cfg = ModelConfig(**DENSE, num_experts=moe, qk_layernorm=True, position_embedding="rope",
                      normalization="RMSNorm", activation="swiglu", add_bias_linear=False)
    assert gpt.te_layer_spec(cfg) == "te" and gpt.local_layer_spec(cfg) == "local"
    assert calls == [("te", (), {"num_experts": moe, "moe_grouped_gemm": False, "qk_layernorm": True}),
                     ("local", (), {"num_experts": moe, "moe_grouped_gemm": False, "qk_layernorm": True,
                                    "normalization": "RMSNorm"})]


def test_te_spec_worker_builds_each_spec_as_build_gpt_asks_for_it(specs):
    """te_spec_worker puts a spec in gpt.layer_spec's place; build_gpt calls that with the
    ModelConfig and the dtype: megatron's builders must still get num_experts=None (a dense
    model), not the ModelConfig (which would build an MoE layer and fail on None % ep_size)."""
    import torch

    from slurm_align.config.run import ModelConfig
    from tests.gpu.te_spec_worker import spec_of

    gpt, calls = specs
    cfg = ModelConfig(**DENSE)
    for choose, kind in ((gpt.te_layer_spec, "te"), (gpt.local_layer_spec, "local")):
        with spec_of(choose):
            assert gpt.layer_spec(cfg, torch.float32) == kind   # the call build_gpt makes
    assert [(k, a, w["num_experts"]) for k, a, w in calls] == [("te", (), None), ("local", (), None)]
    assert gpt.layer_spec(cfg) == "local"                       # restored: fp32's default again


def test_transformer_engine_only_for_half_precision_and_without_lora(specs, monkeypatch):
    """fp32: the local spec (TE's packed THD attention has no fp32 backend, and packing is on by
    default); fp16/bf16: TE's; LoRA: always local; no CUDA or no TE: local."""
    import torch

    from slurm_align.config.run import ModelConfig

    gpt, _ = specs
    cfg = ModelConfig(**DENSE)
    lora = ModelConfig(**DENSE, lora={"rank": 4})
    got = [gpt.layer_spec(cfg, torch.float32), gpt.layer_spec(cfg, torch.bfloat16), gpt.layer_spec(cfg, torch.float16),
           gpt.layer_spec(lora, torch.bfloat16)]
    assert got == ["local", "te", "te", "local"]
    monkeypatch.setattr(gpt, "te_importable", lambda: False)
    assert gpt.layer_spec(cfg, torch.bfloat16) == "local"


def test_packed_input_to_te_attention_in_fp32_is_refused_clearly():
    """A TE-attention model (a stand-in module of that class name) in fp32 is refused before TE
    fails without a backend; in bf16 it takes the THD layout; megatron's local attention never."""
    import torch

    from slurm_align.models.forward import uses_thd

    TEDotProductAttention = type("TEDotProductAttention", (torch.nn.Linear,), {})
    model = torch.nn.Sequential(TEDotProductAttention(4, 4))
    with pytest.raises(ValueError, match=r"Transformer Engine's attention need parameters in torch.float16 or "
                                         r"torch.bfloat16, got torch.float32.*turn packing off"):
        uses_thd(model)
    assert uses_thd(model.to(torch.bfloat16)) is True
    assert uses_thd(torch.nn.Sequential(torch.nn.Linear(4, 4))) is False
