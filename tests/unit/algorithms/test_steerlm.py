"""SteerLM's data steps (algorithms/steerlm.py): the attribute format, and labelling SFT rows
with a regression reward model (in this process, a one-rank world and a tiny 2-attribute
reward model): the written rows carry exactly the model's last-token attributes and the
conditioned input, and load as SFT data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from slurm_align import REPO_ROOT
from slurm_align.algorithms.steerlm import condition, predict_attributes, render_attributes, write_labelled
from slurm_align.algorithms.trainer import Trainer
from slurm_align.analysis.significance import PairedCounts, paired_counts
from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig, RunConfig
from slurm_align.data.datasets import SFTDataset, encode_prompt
from slurm_align.data.helpsteer import ATTRIBUTES, helpsteer_rows, sorted_and_copied
from slurm_align.generation import GptShape
from slurm_align.generation.params import SamplingParams
from slurm_align.generation.refit import refit_from_training
from slurm_align.generation.torch_engine import KVCacheEngine
from slurm_align.losses.regression import AttributeDataset
from slurm_align.models.forward import forward_values, last_token_values
from slurm_align.models.tokenizer import build_tokenizer
from slurm_align.models.worker import ModelWorker
from slurm_align.rewards import sort
from tests.support.learning import ALPHA, TWIN_ALPHA, VERDICT_PREFIX
from tests.support.single_rank import single_rank_world

NAMES = ATTRIBUTES   # ["correctness", "verbosity"]


def test_the_attribute_format_rounds_and_clamps_to_the_0_4_scale():
    assert render_attributes(NAMES, [3.6, -0.7]) == "<attributes>correctness:4,verbosity:0</attributes>"
    assert condition("3142=", NAMES, [9.0, 2.2]) == "3142=<attributes>correctness:4,verbosity:2</attributes>"


def test_labelling_writes_the_reward_models_attributes_and_the_conditioned_input(steer_world, tmp_path: Path):
    src = tmp_path / "sft.jsonl"
    rows = [json.loads(line) for line in (REPO_ROOT / "examples/synthetic/sft_val.jsonl").read_text().splitlines()]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=260, max_seq_len=32,
                      num_labels=2)
    pctx = steer_world   # the module's one-rank world (a second one in this process is refused)
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


# --- SteerLM end to end on the sort task (opt-in) ------------------------------------------------
SYNTH = REPO_ROOT / "examples" / "synthetic"
STEER_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 80}
"""The attribute string (about 50 bytes) does not fit the task's usual 32 positions."""
RM_STEPS, STEER_SFT_STEPS = 300, 800
STEER_SFT_TRAINING = {"lr_decay_style": "cosine", "lr_decay_steps": STEER_SFT_STEPS, "min_lr": 1e-4}
"""Measured (one run, loaded host): at a constant LR 3e-3 the gap swung between 17 and 25 points
from step 500 to 900; decayed to 1e-4 (cosine) it reached 42 points in 600 steps (0.439 vs 0.014),
86 in 1,000."""
MAX_NEW = 12
GAP = 0.30
"""The issue's claim: conditioned on correctness 4 versus 0, held-out exact accuracy differs by
at least 30 points."""


def steer_run(algorithm: str, train: Path, val: Path | None = None, **over) -> RunConfig:
    cfg = {"algorithm": algorithm, "model": STEER_MODEL, "seed": 7, "data": {"train_path": train, "val_path": val},
           "trainer": {"global_batch_size": 32, "micro_batch_size": 32, "lr": 3e-3, "num_steps": 1}}
    return RunConfig(**{**cfg, **over})


def held_out_exact(trainer: Trainer, prompts: list[str], correctness: int) -> np.ndarray:
    """Per held-out prompt, 1 where the greedy answer to the prompt conditioned on `correctness`
    (and on the verbosity of a full-length answer, the same whatever the correctness) is exactly
    the sorted digits, scored by the task's rule on the plain prompt."""
    tok = build_tokenizer(trainer.run.model)
    engine = KVCacheEngine(GptShape.from_model_config(trainer.run.model))
    refit_from_training(engine, trainer.chunks, trainer.pctx, refold=False)
    ids = [torch.tensor(encode_prompt(tok, condition(p, NAMES, [correctness, min(4.0, (len(p) - 1) / 2)]),
                                      STEER_MODEL["max_seq_len"])) for p in prompts]
    out = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, eos_id=tok.eos_id))
    answers = [tok.decode([t for t in r.tolist() if t != tok.eos_id]) for r in out.responses()]
    return np.array([int(sort.exact(a, p)) for a, p in zip(answers, prompts)])


@pytest.fixture(scope="module")
def steer_world() -> Iterator:
    with single_rank_world() as (_, pctx):
        yield pctx


@pytest.fixture(scope="module")
def rm_labels(steer_world, tmp_path_factory: pytest.TempPathFactory) -> tuple[AttributeDataset, torch.Tensor]:
    """The regression reward model (correctness, verbosity) trained on HelpSteer2-format rows of
    the task (slurm_align/data/helpsteer.py: the sorted and the copied answer per prompt), and its
    predicted attributes of every training row (SteerLM's labelling step)."""
    folder = tmp_path_factory.mktemp("steerlm")
    train = helpsteer_rows(SYNTH / "pref_train.jsonl", folder / "helpsteer_train.jsonl", sorted_and_copied)
    run = steer_run("rm", train, model={**STEER_MODEL, "num_labels": 2},
                    loss={"name": "regression", "options": {"attributes": NAMES}})
    rm = Trainer(run, steer_world, folder / "rm")
    for step in range(RM_STEPS):
        rm.train_step(step)
    ds = AttributeDataset(train, build_tokenizer(run.model), STEER_MODEL["max_seq_len"], NAMES, require_labels=False)
    return ds, predict_attributes(rm.worker, ds)


def steered_gap(pctx, ds: AttributeDataset, labels: torch.Tensor, folder: Path) -> PairedCounts:
    """Attribute-conditioned SFT on the labelled rows, then the held-out outcomes conditioned on
    correctness 0 (before) and 4 (after), paired by prompt."""
    folder.mkdir(parents=True)
    sft = Trainer(steer_run("sft", write_labelled(ds, NAMES, labels, folder / "labelled.jsonl"),
                            training=STEER_SFT_TRAINING), pctx, folder / "sft")
    for step in range(STEER_SFT_STEPS):
        sft.train_step(step)
    prompts = [json.loads(line)["prompt"] for line in (SYNTH / "prompts_val.jsonl").read_text().splitlines()]
    return paired_counts(held_out_exact(sft, prompts, 0), held_out_exact(sft, prompts, 4))


@pytest.mark.skipif(os.environ.get("SLURM_ALIGN_STEERLM") != "1",
                    reason="minutes of reward-model and SFT training: set SLURM_ALIGN_STEERLM=1")
def test_steerlm_conditioned_on_correctness_4_beats_0_by_30_points_and_a_shuffled_twin_does_not(
        steer_world, rm_labels, tmp_path: Path):
    """SteerLM end to end: a regression RM labels the rows, SFT conditions on its attributes,
    greedy answers to the 2,000 held-out prompts conditioned on correctness 4 and on 0 (the same
    verbosity) differ by at least GAP in exact accuracy, and by an exact McNemar test on the
    prompts whose outcome differs (p < ALPHA). The broken twin trains on the same labels shuffled
    across rows (the attributes say nothing about their row): it does not reach the gap, nor a
    significant difference (p > TWIN_ALPHA).

    Measured (this host, load average 20 to 70, 310 to 550 s; opt-in for that): correctness 4: 0.830,
    correctness 0: 0.0145 (1,636 prompts right only at 4, 5 only at 0, p < 1e-300); the twin
    0.3085 vs 0.3095 (25 vs 27, p = 0.66)."""
    ds, labels = rm_labels
    steered = steered_gap(steer_world, ds, labels, tmp_path / "run")
    shuffled = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    twin = steered_gap(steer_world, ds, shuffled, tmp_path / "twin")
    record = {"name": "steerlm", "rm_steps": RM_STEPS, "sft_steps": STEER_SFT_STEPS,
              **{k: {"n": c.n, "acc0": c.acc_before, "acc4": c.acc_after, "b": c.b, "c": c.c, "p_better": c.p_better}
                 for k, c in (("steered", steered), ("twin", twin))}}
    print(VERDICT_PREFIX + json.dumps(record), flush=True)
    assert steered.n == 2000
    assert steered.p_better < ALPHA and steered.acc_after - steered.acc_before >= GAP, steered
    assert twin.acc_after - twin.acc_before < GAP and twin.p_better > TWIN_ALPHA, twin


# --- `slurm-align steerlm-label` (algorithms/steerlm_commands.py) --------------------------------
LABEL_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 32}


def regression_rm_run(folder: Path, **model) -> RunConfig:
    train = helpsteer_rows(SYNTH / "pref_val.jsonl", folder / "helpsteer.jsonl", sorted_and_copied)
    return RunConfig(algorithm="rm", seed=3, model={**LABEL_MODEL, "num_labels": 2, **model},
                     data={"train_path": train}, loss={"name": "regression", "options": {"attributes": NAMES}},
                     trainer={"global_batch_size": 16, "micro_batch_size": 16, "lr": 1e-2, "num_steps": 5})


def write_run_config(run: RunConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))


def test_steerlm_label_command_writes_what_the_trained_regression_rm_predicts(steer_world, tmp_path: Path):
    """A 5-step regression reward model saved as a run; `slurm-align steerlm-label` (its own
    process) on 40 SFT rows writes exactly the attributes the trained model predicts in this
    process (not a fresh model's: it loads the checkpoint, the run's attribute names)."""
    run = regression_rm_run(tmp_path)
    run_dir = tmp_path / "rm_run"
    write_run_config(run, run_dir)
    src = tmp_path / "sft.jsonl"
    rows = [json.loads(line) for line in (SYNTH / "sft_val.jsonl").read_text().splitlines()][:40]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pctx = steer_world   # the module's one-rank world (a second one in this process is refused)
    rm = Trainer(run, pctx, run_dir)
    for step in range(5):
        rm.train_step(step)
    rm.step = 5
    rm.save()
    ds = AttributeDataset(src, build_tokenizer(run.model), LABEL_MODEL["max_seq_len"], NAMES, require_labels=False)
    expected = predict_attributes(rm.worker, ds)
    out = tmp_path / "labelled" / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "slurm_align.cli", "steerlm-label",
                           str(run_dir / "checkpoints" / "rm"), "--data", str(src), "--out", str(out),
                           "--batch-size", "16"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 40
    got = torch.tensor([[w[n] for n in NAMES] for w in written])
    assert torch.allclose(got, expected, atol=1e-5), (got[:3], expected[:3])
    for row, w, p in zip(rows, written, expected.tolist()):
        assert w["output"] == row["output"] and w["input"] == condition(row["input"], NAMES, p)


def test_steerlm_label_refuses_a_missing_checkpoint_a_scalar_rm_and_missing_data(tmp_path: Path, capsys):
    from slurm_align.algorithms.steerlm_commands import rm_config
    from slurm_align.cli import main


    with pytest.raises(ConfigError, match="no such checkpoint"):
        rm_config(tmp_path / "nowhere", None, [])
    scalar = RunConfig(algorithm="rm", model={**LABEL_MODEL, "num_labels": 1},
                       data={"train_path": SYNTH / "pref_val.jsonl"})
    write_run_config(scalar, tmp_path / "bt")
    (tmp_path / "bt" / "checkpoints" / "rm").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"field 'loss.name': got '\w+'.*regression.*model.num_labels=1"):
        rm_config(tmp_path / "bt" / "checkpoints" / "rm", None, [])
    write_run_config(regression_rm_run(tmp_path), tmp_path / "two")
    (tmp_path / "two" / "checkpoints" / "rm").mkdir(parents=True)
    assert main(["steerlm-label", str(tmp_path / "two" / "checkpoints" / "rm"), "--data", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path / "out.jsonl")]) == 2
    assert "field '--data'" in capsys.readouterr().err


# --- generation conditioned on chosen attributes (eval.attributes, --attributes) -----------------
def test_eval_and_generate_with_attributes_give_the_engine_conditioned_prompts_and_the_scorer_plain_ones(
        tmp_path: Path):
    """`slurm-align eval/generate ... --attributes correctness=4,verbosity=2`: the prompts the
    engine generates from are each prompt with the attributes rendered (in the given order), the
    rows the scorer reads keep the plain prompt; without the flag the prompts are plain."""
    from slurm_align.algorithms.commands import attribute_overrides, eval_overrides
    from slurm_align.algorithms.evaluation import EvalSet
    from slurm_align.algorithms.generate import prompt_dataset
    from slurm_align.cli import build_parser
    from slurm_align.config import load_run_config

    data = SYNTH / "prompts_val.jsonl"
    plain = [json.loads(line)["prompt"] for line in data.read_text().splitlines()[:5]]
    common = ["eval", str(tmp_path), "--data", str(data), "--config", str(REPO_ROOT / "examples/grpo_tiny.yaml")]
    for flag, values in (([], None), (["--attributes", "verbosity=2,correctness=4"], {"verbosity": 2.0,
                                                                                       "correctness": 4.0})):
        args = build_parser().parse_args([*common, *flag])
        args.overrides = ["model.max_seq_len=80", "eval.num_prompts=5"]
        run = load_run_config(*eval_overrides(args.model, args))
        tok = build_tokenizer(run.model)
        evalset = EvalSet.from_run(run, tok)
        assert evalset is not None and dict(run.eval.attributes) == (values or {})
        want = [p if values is None else condition(p, list(values), list(values.values())) for p in plain]
        assert [list(ids) for ids in evalset.prompts] == [encode_prompt(tok, w, 80) for w in want]
        assert [r["prompt"] for r in evalset.rows] == plain
        generated = prompt_dataset(run, data, tok)
        assert [list(generated.token_arrays()[i]) for i in range(5)] == [encode_prompt(tok, w, 80) for w in want]
    assert want[0] == plain[0] + "<attributes>verbosity:2,correctness:4</attributes>"
    with pytest.raises(ConfigError, match=r"--attributes.*'correctness' is not name=number"):
        attribute_overrides("verbosity=2,correctness")
