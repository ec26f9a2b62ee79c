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
    assert local_name("decoder.layers.3.self_attention.linear_qkv.weight") == "decoder.layers.3.self_attention.linear_qkv.weight"


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
