"""The actor's engine gets this rank's device and the generation layout, for every engine kind
(CPU: TensorRT-LLM's engine is checked through the arguments the factory hands it, without
importing tensorrt_llm)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.ppo import actor_engine
from slurm_align.config import load_run_config
from slurm_align.generation import GptShape
from slurm_align.generation.naive_engine import NaiveEngine
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.generation.trtllm_engine import TrtllmEngine

EXAMPLE = REPO_ROOT / "examples" / "ppo_tiny.yaml"


@dataclass(frozen=True)
class Layout:   # the fields of parallel.layout.GenerationLayout an engine may read
    refold: bool
    dp_rank: int = 5
    dp_size: int = 8
    tp_rank: int = 1
    tp_size: int = 2
    pp_rank: int = 0
    pp_size: int = 1


@dataclass(frozen=True)
class Env:
    device: str


class Pctx:
    """Records which generation layout the actor asked for."""

    def __init__(self):
        self.asked: list[bool] = []

    @contextlib.contextmanager
    def generation_layout(self, refold: bool):
        self.asked.append(refold)
        yield Layout(refold)


@pytest.mark.parametrize("device", ["cpu", "cuda:3"])
@pytest.mark.parametrize("kv_cache,cls", [(True, KVCacheEngine), (False, NaiveEngine)])
def test_torch_engines_get_the_ranks_device(device, kv_cache, cls):
    run = load_run_config(EXAMPLE, [f"switches.kv_cache_engine={str(kv_cache).lower()}", "switches.refold=false"])
    pctx = Pctx()
    engine = actor_engine(run, Env(device), pctx)
    assert type(engine) is cls
    assert engine.device == torch.device(device)   # weights are allocated on refit, not here
    assert engine.shape == GptShape.from_model_config(run.model)
    assert pctx.asked == [False]


@pytest.mark.parametrize("refold", [True, False])
def test_trtllm_gets_the_device_and_the_generation_layout(monkeypatch, refold):
    calls = []

    def for_layout(cls, shape, layout, **kwargs):
        calls.append((shape, layout, kwargs))
        return "engine"

    monkeypatch.setattr(TrtllmEngine, "for_layout", classmethod(for_layout))
    run = load_run_config(EXAMPLE, ["generation.engine=trtllm", f"switches.refold={str(refold).lower()}",
                                    "generation.trtllm.kv_cache_fraction=0.3"])
    pctx = Pctx()
    assert actor_engine(run, Env("cuda:1"), pctx) == "engine"
    (shape, layout, kwargs), = calls
    assert shape == GptShape.from_model_config(run.model)
    assert layout == Layout(refold) and pctx.asked == [refold]   # TP comes from this layout
    # TensorRT-LLM's max_input_len from the run's lengths (its default, 1024, refuses longer prompts)
    # and the rest of the run's generation.trtllm section
    want = run.generation.trtllm.model_dump() | {"max_input_len": run.model.max_seq_len - run.generation.max_new_tokens}
    assert kwargs == {"device": "cuda:1", **want} and kwargs["kv_cache_fraction"] == 0.3
    assert "tensorrt_llm" not in sys.modules
