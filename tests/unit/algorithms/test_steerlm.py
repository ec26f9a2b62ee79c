"""SteerLM's data steps (algorithms/steerlm.py): the attribute format, and labelling SFT rows
with a regression reward model (in this process, a one-rank world and a tiny 2-attribute
reward model): the written rows carry exactly the model's last-token attributes and the
conditioned input, and load as SFT data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.steerlm import condition, predict_attributes, render_attributes, write_labelled
from slurm_align.config.run import ModelConfig
from slurm_align.data.datasets import SFTDataset
from slurm_align.losses.regression import AttributeDataset
from slurm_align.models.forward import forward_values, last_token_values
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.worker import ModelWorker
from tests.support.single_rank import single_rank_world

NAMES = ["correctness", "verbosity"]


def test_the_attribute_format_rounds_and_clamps_to_the_0_4_scale():
    assert render_attributes(NAMES, [3.6, -0.7]) == "<attributes>correctness:4,verbosity:0</attributes>"
    assert condition("3142=", NAMES, [9.0, 2.2]) == "3142=<attributes>correctness:4,verbosity:2</attributes>"


def test_labelling_writes_the_reward_models_attributes_and_the_conditioned_input(tmp_path: Path):
    src = tmp_path / "sft.jsonl"
    rows = [json.loads(line) for line in (REPO_ROOT / "examples/synthetic/sft_val.jsonl").read_text().splitlines()]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=260, max_seq_len=32,
                      num_labels=2)
    with single_rank_world() as (_, pctx):
        worker = ModelWorker(cfg, pctx, seed=5, value_head=True, batching=7)
        tok = build_tokenizer(cfg)
        ds = AttributeDataset(src, tok, cfg.max_seq_len, NAMES, require_labels=False)
        first = predict_attributes(worker, ds)
        with torch.no_grad():   # rescale the fresh head so that its outputs spread over the 0-4 scale
            head = worker.chunks[0].value_head
            head.weight.div_(first.std(0)[:, None])
            head.bias.copy_(2.0 - (first.mean(0) - head.bias) / first.std(0))
        pred = predict_attributes(worker, ds)
        batch = ds.batch(list(range(len(ds))))
        direct = last_token_values(forward_values(worker.chunks, pctx, batch["tokens"], lengths=batch["lengths"],
                                                  num_labels=2), batch["lengths"])
    assert pred.shape == (40, 2) and torch.allclose(pred, direct, atol=1e-5)
    assert len({render_attributes(NAMES, p) for p in pred.tolist()}) > 3   # the labels differ by row
    out = write_labelled(ds, NAMES, pred, tmp_path / "labelled.jsonl")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for row, w, p in zip(rows, written, pred.tolist()):
        assert w["output"] == row["output"] and [w[n] for n in NAMES] == p
        assert re.fullmatch(re.escape(row["input"]) + r"<attributes>correctness:[0-4],verbosity:[0-4]</attributes>",
                            w["input"]), w["input"]
        assert w["input"] == condition(row["input"], NAMES, p)
    assert len(SFTDataset(out, tok, 64)) == 40
