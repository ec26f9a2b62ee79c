"""Batch generation (algorithms/generate.py) in this process, a one-rank world and a tiny random
GPT loaded as the job loads it (algorithms/standalone.py): N samples per prompt, the same rows
again for the same seed and other responses for another; the stored top-K log-probs are the
model's own forward (recomputed here unbatched in float64); a job stopped with shards missing
(and a half-written temp file left) writes exactly those on resume, each prompt once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.generate import GenerateSpec, generate_shards, read_shards, shard_path
from slurm_align.algorithms.standalone import StandaloneActor, load_standalone_actor
from slurm_align.config import load_run_config
from slurm_align.data.datasets import PromptDataset
from slurm_align.generation.params import SamplingParams
from slurm_align.models.forward import model_inputs
from slurm_align.parallel.bootstrap import init_distributed, shutdown_distributed
from tests.support.single_rank import mpi

PROMPTS = 7
SPEC = GenerateSpec(samples=3, temperature=1.0, top_k_logprobs=4, shard_size=3, max_new_tokens=6, seed=11,
                    forward_batch=5)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Iterator[tuple[StandaloneActor, object, dict]]:
    """The actor as `slurm-align generate` loads it (random init: no checkpoint), and the data."""
    data = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = (REPO_ROOT / "examples/synthetic/prompts_val.jsonl").read_text().splitlines()[:PROMPTS]
    data.write_text("\n".join(lines) + "\n")
    run = load_run_config(REPO_ROOT / "examples/grpo_tiny.yaml", ["actor.data_parallel=1", "model.max_seq_len=24"])
    env = init_distributed(comm=mpi().COMM_SELF, backend="gloo")
    actor = load_standalone_actor(run, env)
    try:
        ds = PromptDataset(data, actor.tokenizer, run.model.max_seq_len)
        yield actor, env, {"prompts": ds.token_arrays(), "rows": ds.fields(), "vocab_size": run.model.vocab_size,
                           "params": SamplingParams.from_config(run.generation, eos_id=actor.tokenizer.eos_id,
                                                                pad_id=actor.tokenizer.pad_id)}
    finally:
        actor.pctx.destroy()
        shutdown_distributed(env)


def generate(job, out: Path, spec: GenerateSpec = SPEC) -> list[int]:
    actor, env, d = job
    return generate_shards(actor.engine, actor.policy, actor.pctx, env.comm, prompts=d["prompts"], rows=d["rows"],
                           out_dir=out, spec=spec, params=d["params"], tokenizer=actor.tokenizer,
                           vocab_size=d["vocab_size"])


def test_n_samples_per_prompt_reproducible_per_seed_and_top_k_is_the_models_forward(job, tmp_path: Path):
    assert generate(job, tmp_path / "a") == [0, 1, 2]   # 7 prompts in shards of 3
    rows = read_shards(tmp_path / "a")
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(PROMPTS) for j in range(3)]
    assert generate(job, tmp_path / "b") == [0, 1, 2]
    assert read_shards(tmp_path / "b") == rows, "the same seed draws the same rows"
    generate(job, tmp_path / "c", GenerateSpec(**{**SPEC.__dict__, "seed": 12}))
    other = read_shards(tmp_path / "c")
    assert sum(r["response_ids"] != o["response_ids"] for r, o in zip(rows, other)) > len(rows) // 2
    assert len({tuple(r["response_ids"]) for r in rows}) > PROMPTS, "samples of a prompt differ"

    actor = job[0]
    model = actor.policy[0]
    model.eval()
    worst_topk = worst_engine = 0.0
    with torch.no_grad():
        for r in rows:
            seq = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            logits = model(**model_inputs(seq))[0, :, :job[2]["vocab_size"]].double()
            logp = torch.log_softmax(logits, -1)
            p, m = len(r["prompt_ids"]), len(r["response_ids"])
            assert len(r["topk_ids"]) == len(r["topk_logprobs"]) == len(r["logprobs"]) == m
            for t in range(m):
                row = logp[p - 1 + t]
                ids, vals = torch.tensor(r["topk_ids"][t]), torch.tensor(r["topk_logprobs"][t], dtype=torch.float64)
                assert len(ids) == 4 and len(set(ids.tolist())) == 4
                worst_topk = max(worst_topk, float((row[ids] - vals).abs().max()))
                rest = torch.ones_like(row, dtype=torch.bool)
                rest[ids] = False
                assert float(row[rest].max()) <= float(vals.min()) + 1e-6, "the K most likely tokens"
                assert (vals[:-1] >= vals[1:]).all(), "descending"
                worst_engine = max(worst_engine, abs(float(row[r["response_ids"][t]]) - r["logprobs"][t]))
    assert worst_topk < 1e-5, worst_topk
    assert worst_engine < 1e-4, "the engine's log-probs of the sampled tokens are the model's too"


def test_a_resumed_job_writes_the_missing_shards_only_and_each_prompt_once(job, tmp_path: Path):
    out = tmp_path / "gen"
    generate(job, out)
    before = read_shards(out)
    # a stop after shard 0: shards 1 and 2 never written, one left as write_atomic's temp file
    shard_path(out, 1).unlink()
    stray = shard_path(out, 2)
    stray.rename(stray.with_name(f".{stray.name}.tmp999"))
    kept = shard_path(out, 0).stat().st_mtime_ns
    assert generate(job, out) == [1, 2]
    assert shard_path(out, 0).stat().st_mtime_ns == kept, "a finished shard is kept, not redone"
    after = read_shards(out)
    assert Counter((r["index"], r["sample"]) for r in after) == Counter(
        (i, j) for i in range(PROMPTS) for j in range(3)), "each prompt's samples exactly once"
    assert after == before, "the resumed shards draw what the first run drew"
    assert generate(job, out) == [], "nothing left to do"
    assert json.loads(shard_path(out, 2).read_text().splitlines()[0])["index"] == 6


def test_without_top_k_each_shard_is_written_as_generated_with_the_same_rows(job, tmp_path: Path):
    plain = GenerateSpec(**{**SPEC.__dict__, "top_k_logprobs": 0})
    assert generate(job, tmp_path / "plain", plain) == [0, 1, 2]
    rows = read_shards(tmp_path / "plain")
    generate(job, tmp_path / "topk")
    with_k = read_shards(tmp_path / "topk")
    assert "topk_ids" not in rows[0]
    assert [{k: v for k, v in r.items() if not k.startswith("topk")} for r in with_k] == rows, \
        "the same samples, with or without the top-K forward"
