"""Mixtures of prompt sets: proportions, each source's rows used before repeating, the same
sequence after a restart, and the run's config (data.mixture) through to the prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slurm_align.algorithms.rollout_collector import prompt_order
from slurm_align.config import ConfigError, load_run_config
from slurm_align.data.mixture import Mixture, run_prompts
from slurm_align.models.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "grpo_tiny.yaml"


def test_weights_075_025_draw_within_a_binomial_bound_over_2000():
    mix = Mixture([500, 300], [0.75, 0.25], seed=3, length=2000)
    first = int((mix.source == 0).sum())
    sd = math.sqrt(2000 * 0.75 * 0.25)
    assert abs(first - 1500) < 4 * sd, f"{first} of 2000 from the 0.75 source"
    other = Mixture([500, 300], [0.25, 0.75], seed=3, length=2000)
    assert abs(int((other.source == 0).sum()) - 500) < 4 * sd, "the weights, not the sizes, set the shares"


def test_a_source_repeats_a_row_only_after_using_all_its_rows():
    mix = Mixture([10, 1000], [0.5, 0.5], seed=0, length=400)
    small = mix.row[mix.source == 0]
    assert len(small) > 20
    for start in range(0, len(small) - 9, 10):   # each run of 10 draws is the whole source
        assert sorted(small[start:start + 10].tolist()) == list(range(10))


def _write_sources(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.parquet", tmp_path / "b.jsonl"
    pq.write_table(pa.table({"question": [f"{i:03d}=" for i in range(60)], "gold": [str(i) for i in range(60)]}), a)
    b.write_text("".join(json.dumps({"prompt": f"b{i}=", "answer": f"b{i}"}) + "\n" for i in range(20)))
    return a, b


def _run(tmp_path: Path, *overrides: str):
    a, b = _write_sources(tmp_path)
    mixture = (f"[{{path: {a}, weight: 0.75, columns: {{prompt: question, answer: gold}}}}, "
               f"{{path: {b}, weight: 0.25}}]")
    return load_run_config(EXAMPLE, ["data.train_path=null", f"data.mixture={mixture}", *overrides])


def test_a_restarted_run_continues_the_exact_sample_sequence(tmp_path: Path):
    """Steps 1-6 drawn in one go equal steps 1-3, a restart (fresh objects, other global
    random state), then steps 4-6."""
    run = _run(tmp_path)
    tok = ByteTokenizer()

    def steps(first: int, last: int) -> list[list[tuple]]:
        data = run_prompts(run, tok)
        prompts, fields = data.token_arrays(), data.fields()
        out = []
        for step in range(first, last + 1):
            order = prompt_order(run, len(prompts), step)
            out.append([(tuple(prompts[i].tolist()), fields[i]["answer"]) for i in order])
        return out

    whole = steps(1, 6)
    np.random.seed(12345)
    np.random.rand(100)   # a restarted process's global random state differs
    assert steps(1, 3) + steps(4, 6) == whole
    drawn = [answer for step in whole for _, answer in step]
    assert any(a.startswith("b") for a in drawn) and any(not a.startswith("b") for a in drawn), "both sources"


def test_mixture_config_maps_columns_per_source_and_refuses_train_path_too(tmp_path: Path):
    run = _run(tmp_path)
    data = run_prompts(run, ByteTokenizer())
    assert len(data) == 80
    for f, ids in zip(data.fields(), data.token_arrays()[:]):
        assert bytes(ids[1:].tolist()).decode() == f["prompt"]
        assert f["prompt"] == (f"{f['answer']}=" if f["answer"].startswith("b") else f"{int(f['answer']):03d}=")
    with pytest.raises(ConfigError, match="either train_path or mixture"):
        _run(tmp_path, f"data.train_path={tmp_path / 'b.jsonl'}")
    assert _run(tmp_path, "algorithm=kd").data.mixture, "kd reads a mixture of generate outputs too (test_distill)"
