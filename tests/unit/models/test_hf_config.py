"""config.json as slurm_align writes it (models/hf/config.py): the RoPE keys both transformers
generations read. transformers >= 5 reads `rope_parameters` (rope_theta inside); transformers 4.x
(TensorRT-LLM 1.2.1 pins 4.57.3) reads only `rope_scaling` and `rope_theta`, so Llama-3 scaling
written under the new key alone is silently dropped there (RoPE built without it)."""

from __future__ import annotations

import json

import pytest
import transformers

from slurm_align.config.run import ModelConfig
from slurm_align.generation.trtllm_mapping import hf_config
from slurm_align.models.hf.config import hf_config_dict, model_fields

LLAMA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 100,
         "max_seq_len": 64, "position_embedding": "rope", "normalization": "RMSNorm", "activation": "swiglu",
         "add_bias_linear": False, "rotary_base": 50000.0}
SCALING = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("write", [hf_config_dict, hf_config], ids=["export", "tensorrt-llm"])
def test_llama3_rope_scaling_is_written_under_both_keys(write):
    cfg = ModelConfig(**LLAMA, rope_scaling=SCALING)
    d = write(cfg, "llama") if write is hf_config_dict else write(cfg)
    # transformers 4.x's LlamaConfig: rope_scaling {rope_type, factor, low/high_freq_factor,
    # original_max_position_embeddings} and rope_theta at the top
    assert d["rope_scaling"] == {"rope_type": "llama3", **SCALING}
    assert d["rope_theta"] == 50000.0
    # transformers 5's: the same inside rope_parameters, with rope_theta
    assert d["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 50000.0, **SCALING}


def test_plain_rope_writes_a_null_rope_scaling():
    d = hf_config(ModelConfig(**LLAMA))
    assert d["rope_scaling"] is None and d["rope_theta"] == 50000.0
    assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}


@pytest.mark.parametrize("scaling", [None, SCALING], ids=["plain", "llama3"])
def test_both_readers_get_the_same_rope_back(tmp_path, scaling):
    """Our reader and this transformers (5.x) read the written file back to the same RoPE; and a
    file a transformers-4 writer made (rope_scaling only) reads back the same too."""
    cfg = ModelConfig(**LLAMA, rope_scaling=scaling)
    d = hf_config(cfg)
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.rope_parameters == d["rope_parameters"]
    old_style = {k: v for k, v in d.items() if k != "rope_parameters"}
    for data in (d, old_style):
        fields = model_fields(data, tmp_path / "config.json")
        assert fields["rotary_base"] == 50000.0
        got = fields["rope_scaling"]
        assert (got if got is None or isinstance(got, dict) else got.model_dump()) == scaling
