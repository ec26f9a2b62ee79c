"""The model worker (models/worker.py) with registered losses, in this process on a one-rank
world (tests/support/single_rank.py) and a tiny GPT: the Trainer's steps through it, its
forward pass, and a learning check of the preference losses against a swapped control."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.trainer import Trainer
from slurm_align.analysis.significance import sign_test
from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import PreferenceDataset
from slurm_align.losses.base import sequence_logprobs
from slurm_align.models.forward import last_token_values, per_sequence, sequence_token_logprobs
from slurm_align.models.tokenizer import build_tokenizer
from tests.support.single_rank import single_rank_world

SYNTH = REPO_ROOT / "examples" / "synthetic"
STEPS_REGRESSION = 100
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 32}


@pytest.fixture(scope="module")
def pctx() -> Iterator:
    with single_rank_world() as (_, p):
        yield p


def make_run(algorithm: str, train: Path, val: Path | None = None, **over) -> RunConfig:
    cfg = {"algorithm": algorithm, "model": MODEL, "seed": 7, "data": {"train_path": train, "val_path": val},
           "trainer": {"global_batch_size": 16, "micro_batch_size": 16, "lr": 1e-3, "num_steps": 1}}
    return RunConfig(**{**cfg, **over})


def held_out_margins(trainer: Trainer, ds) -> torch.Tensor:
    """Per held-out pair: (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), in ds order."""
    vocab = trainer.run.model.vocab_size

    def margin(output, mb):
        lp = sequence_token_logprobs(output, mb, vocab)
        delta = sequence_logprobs(lp, mb["mask"]) - sequence_logprobs(mb["ref_logp"].to(lp), mb["mask"])
        c, r = delta.chunk(2)
        return {"margin": (c - r).double()}

    out = trainer.worker.forward(ds, list(range(len(ds))), margin, reference=True)
    return out["margin"][out["index"].argsort()]


def swapped(src: Path, dst: Path) -> Path:
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    dst.write_text("".join(json.dumps({**r, "chosen": r["rejected"], "rejected": r["chosen"]}) + "\n" for r in rows))
    return dst


def test_each_trainer_loss_takes_steps_through_the_worker(pctx, tmp_path: Path):
    """sft / rm / dpo: the registered loss (RunConfig.loss) through ModelWorker.train; the
    loss falls over a few steps on the same batch and the reference-free losses get no ref_logp."""
    for algorithm, data in (("sft", "sft_train.jsonl"), ("rm", "pref_train.jsonl"), ("dpo", "pref_train.jsonl")):
        trainer = Trainer(make_run(algorithm, SYNTH / data), pctx, tmp_path / algorithm)
        assert type(trainer.loss).__name__ == {"sft": "NLL", "rm": "BradleyTerry", "dpo": "Preference"}[algorithm]
        assert (trainer.worker.reference is not None) == (algorithm == "dpo")
        first = trainer.train_step(0)
        for _ in range(4):
            last = trainer.train_step(0)
        assert last["loss"] < first["loss"], (algorithm, first, last)
        assert last["grad_norm"] > 0


@pytest.mark.parametrize("kind", ["dpo", "ipo", "rpo_sq", "rpo_fwd_kl", "rpo_bwd_kl"])
def test_preference_losses_raise_the_held_out_margin_and_a_swapped_control_does_not(pctx, tmp_path: Path, kind: str):
    """Trained on the task's pairs, the held-out implicit margin is positive on most pairs (sign
    test) and above the control's pair by pair; the control (chosen and rejected swapped)
    learns the opposite. A wrong sign in the loss, or no reference, fails one of them."""
    steps, options = 25, {"preference_loss": kind, "beta": 0.1}
    margins = {}
    for name, data in (("trained", SYNTH / "pref_train.jsonl"),
                       ("control", swapped(SYNTH / "pref_train.jsonl", tmp_path / "swapped.jsonl"))):
        trainer = Trainer(make_run("dpo", data, SYNTH / "pref_val.jsonl", loss={"options": options}), pctx,
                          tmp_path / name)
        for step in range(steps):
            trainer.train_step(step)
        margins[name] = held_out_margins(trainer, trainer.val_ds)
    t, c = margins["trained"], margins["control"]
    n = len(t)
    assert sign_test(int((t > 0).sum()), int((t < 0).sum())) < 1e-3, t
    assert sign_test(int((c < 0).sum()), int((c > 0).sum())) < 1e-3, c
    assert sign_test(int((t > c).sum()), int((t < c).sum())) < 1e-3 and n == 200


def attribute_rows(src: Path, dst: Path) -> Path:
    """HelpSteer2-format rows (0-4 labels) from the task's preference pairs, each response with
    two attributes computed from its text: verbosity from its length, complexity from its first
    digit (nearly uncorrelated with the length, so one head cannot serve both)."""
    out = []
    for line in src.read_text().splitlines():
        r = json.loads(line)
        for resp in (r["chosen"], r["rejected"]):
            out.append({"input": r["prompt"], "output": resp, "verbosity": min(4.0, len(resp) / 2),
                        "complexity": 4.0 * int(resp[0]) / 9 if resp else 0.0})
    dst.write_text("".join(json.dumps(o) + "\n" for o in out))
    return dst


def test_a_regression_reward_model_predicts_each_attribute_on_held_out_rows(pctx, tmp_path: Path):
    """N attribute heads trained with MSE (loss 'regression', model.num_labels = 2): on held-out
    rows each head's prediction correlates with its own attribute (Pearson >= 0.8) and not with
    the other one (|r| < 0.5)."""
    attributes = ["verbosity", "complexity"]
    train = attribute_rows(SYNTH / "pref_train.jsonl", tmp_path / "train.jsonl")
    val = attribute_rows(SYNTH / "pref_val.jsonl", tmp_path / "val.jsonl")
    run = make_run("rm", train, val, model={**MODEL, "num_labels": 2},
                   trainer={"global_batch_size": 32, "micro_batch_size": 32, "lr": 3e-3, "num_steps": 1},
                   loss={"name": "regression", "options": {"attributes": attributes}})
    trainer = Trainer(run, pctx, tmp_path / "rm")
    for step in range(STEPS_REGRESSION):
        trainer.train_step(step)

    def scores(output, mb):
        return {"pred": last_token_values(per_sequence(output, mb), mb["lengths"]), "labels": mb["labels"]}

    out = trainer.worker.forward(trainer.val_ds, list(range(len(trainer.val_ds))), scores)
    r = torch.corrcoef(torch.cat([out["pred"].T, out["labels"].T]))   # pred 0, pred 1, label 0, label 1
    assert abs(float(r[2, 3])) < 0.3, r          # the attributes themselves are nearly independent
    for i in range(2):
        assert float(r[i, 2 + i]) >= 0.8, (attributes[i], r)
        assert abs(float(r[i, 3 - i])) < 0.5, (attributes[i], r)


def test_kto_raises_the_held_out_margin_of_desirable_over_undesirable(pctx, tmp_path: Path):
    """KTO on unpaired rows (the task's chosen answers desirable, rejected ones undesirable):
    on held-out pairs, log pi - log ref of the sorted answer exceeds the corrupted one's on
    most pairs (sign test)."""
    rows = [json.loads(line) for line in (SYNTH / "pref_train.jsonl").read_text().splitlines()]
    kto = tmp_path / "kto.jsonl"
    kto.write_text("".join(json.dumps({"input": r["prompt"], "output": r[k], "label": k == "chosen"}) + "\n"
                           for r in rows for k in ("chosen", "rejected")))
    trainer = Trainer(make_run("kto", kto, loss={"options": {"beta": 0.5}}), pctx, tmp_path / "run")
    assert type(trainer.loss).__name__ == "KTO"
    for step in range(25):
        trainer.train_step(step)
    val = PreferenceDataset(SYNTH / "pref_val.jsonl", build_tokenizer(trainer.run.model), MODEL["max_seq_len"])
    m = held_out_margins(trainer, val)
    assert sign_test(int((m > 0).sum()), int((m < 0).sum())) < 1e-3, m


def test_a_trainers_checkpoints_folder_as_init_checkpoint_loads_its_newest(pctx, tmp_path: Path):
    """model.init_checkpoint may name a trainer's checkpoints folder (checkpoints/sft), as the RL
    actor takes it: the worker loads the newest complete iter_* in it, not the first or none."""
    sft = Trainer(make_run("sft", SYNTH / "sft_train.jsonl"), pctx, tmp_path / "sft")
    for step in (1, 2):
        sft.train_step(0)
        sft.step = step
        sft.save()
    newest = {k: v.clone() for k, v in sft.chunks[0].state_dict().items() if isinstance(v, torch.Tensor)}
    dpo = Trainer(make_run("dpo", SYNTH / "pref_train.jsonl", model={**MODEL, "init_checkpoint": sft.ckpt_root}),
                  pctx, tmp_path / "dpo")
    assert dpo.worker.init_checkpoint == sft.ckpt_root / "iter_0000002"
    loaded = dpo.chunks[0].state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in newest.items() if "_extra_state" not in k)
