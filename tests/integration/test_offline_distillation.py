"""Offline knowledge distillation end to end with the real commands, against SFT on the same
teacher samples. The teacher is the session's SFT-trained sort policy (`sft_checkpoint`: the main
job's trained policy); `slurm-align generate` samples it on the training prompts with its top-K
log-probs; students smaller than the teacher (half its hidden size) train from the same initial
weights for the same steps on the same rows in the same order (same seed, same rows: those whose
SFT tokens are the KD tokens): `train kd` with `rest_mass` (the KL over the K ids and the rest),
`train kd` with the renormalised top-K KL, and `train sft` on the same responses. On the 2,000
held-out prompts:

  - exact accuracy of each student's greedy answers (`slurm-align eval`, the sort rule as an
    independent scorer): KD above SFT by an exact one-sided McNemar test on per-prompt outcomes;
  - KL(teacher || student), full vocabulary, averaged over the response tokens of the teacher's
    own sample of each held-out prompt (a second `generate` on the held-out prompts): KD
    (rest_mass) below SFT by an exact sign test over prompts. The renormalised loss is blind to
    the student's mass outside the K ids: its KL is reported, not claimed (measured: 1.84 against
    SFT's 0.29; docs/algorithms/distillation.md has the table).

Minutes of CPU: opt in with SLURM_ALIGN_OFFLINE_KD=1. (In the suite: the top-K KD reads equals the
teacher's own forward, tests/unit/algorithms/test_generate.py; the loss against a hand
computation and a KD student against a shuffled-target twin, tests/unit/losses/test_distill.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.generate import read_shards
from slurm_align.analysis.significance import paired_counts, sign_test
from slurm_align.cli import main
from slurm_align.config import load_run_config
from slurm_align.data.datasets import SFTDataset, encode_pair
from slurm_align.losses.distill import DistillDataset
from slurm_align.models.checkpoint import find_latest, load_weights
from slurm_align.models.forward import model_inputs
from slurm_align.models.gpt import build_gpt
from slurm_align.models.tokenizer import build_tokenizer
from tests.support.single_rank import single_rank_world

pytestmark = pytest.mark.skipif(os.environ.get("SLURM_ALIGN_OFFLINE_KD") != "1",
                                reason="offline KD against SFT takes minutes: SLURM_ALIGN_OFFLINE_KD=1")

SYNTH = REPO_ROOT / "examples" / "synthetic"
GRPO = REPO_ROOT / "examples" / "grpo_tiny.yaml"    # a rollout config: what generate and eval take
SFT = REPO_ROOT / "examples" / "sft_tiny.yaml"
STUDENT = ["model.hidden_size=32"]                  # the teacher (sft_tiny): 2 layers x 64
K, SAMPLES, STEPS = 8, 4, 100
ALPHA = 1e-3


def generate(model: Path, data: Path, run_dir: Path, *args: str) -> list[dict]:
    assert main(["generate", str(model), "--data", str(data), "--config", str(GRPO), "--profile", "local",
                 "--run-dir", str(run_dir), "--follow", *args]) == 0
    return read_shards(run_dir / "generate")


def same_samples(rows: list[dict], out: Path) -> tuple[Path, Path]:
    """generate's rows (for KD) and the same responses as SFT rows, keeping the rows whose SFT
    tokens are the KD tokens: SFT re-encodes the response text and appends EOS, so a response cut
    at max_new_tokens (no EOS) or holding a byte that does not decode (the tokenizer's replacement
    character re-encodes as three bytes) would differ."""
    tok = build_tokenizer(load_run_config(SFT, STUDENT).model)
    text = lambda r: {"input": r["prompt"], "output": r["response"]}   # noqa: E731
    kept = [r for r in rows if encode_pair(tok, r["prompt"], r["response"], 64).ids
            == r["prompt_ids"] + r["response_ids"]]
    assert len(kept) > 0.9 * len(rows), f"only {len(kept)} of {len(rows)} teacher samples are the same as SFT rows"
    kd_data, sft_data = out / "kd.jsonl", out / "sft.jsonl"
    kd_data.write_text("".join(json.dumps(r) + "\n" for r in kept))
    sft_data.write_text("".join(json.dumps(text(r)) + "\n" for r in kept))
    kd_ds, sft_ds = DistillDataset(kd_data, tok, 32), SFTDataset(sft_data, tok, 32)
    assert len(kd_ds) == len(sft_ds) == len(kept)
    assert all(kd_ds.item(i) == sft_ds.items[i] for i in range(len(kept))), "the students train on the same tokens"
    return kd_data, sft_data


def train(algorithm: str, run_dir: Path, *overrides: str) -> Path:
    assert main(["train", algorithm, str(SFT), "--profile", "local", "--run-dir", str(run_dir), "--follow",
                 *STUDENT, "seed=7", f"trainer.num_steps={STEPS}", "trainer.save_interval=0",
                 "data.val_path=null", *overrides]) == 0
    return run_dir / "checkpoints" / algorithm


def evaluate(model: Path, run_dir: Path, *shape: str) -> np.ndarray:
    """Per held-out prompt, 1 where the greedy answer sorts its digits exactly."""
    assert main(["eval", str(model), "--data", str(SYNTH / "prompts_val.jsonl"), "--config", str(GRPO),
                 "--profile", "local", "--run-dir", str(run_dir), "--temperature", "0", "--follow", *shape,
                 "eval.scorer=slurm_align.rewards.sort:exact"]) == 0
    (path,) = (run_dir / "eval").glob("step_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(2000))
    return np.asarray([r["correct"] for r in rows])


@torch.no_grad()
def held_out_kl(teacher: Path, students: dict[str, Path], rows: list[dict]) -> dict[str, np.ndarray]:
    """Per row (one teacher sample of a held-out prompt): the mean over its response tokens of
    KL(teacher || student) over the whole vocabulary, float64."""
    teacher_run = load_run_config(SFT)
    student_run = load_run_config(SFT, STUDENT)
    V = teacher_run.model.vocab_size
    out: dict[str, list[float]] = {name: [] for name in students}
    with single_rank_world() as (_, pctx):
        def load(run, path: Path) -> torch.nn.Module:
            chunks = build_gpt(run.model, pctx, seed=run.seed)
            load_weights(find_latest(path) or path, chunks)
            chunks[0].eval()
            return chunks[0]

        models = {"teacher": load(teacher_run, teacher)} | {n: load(student_run, p) for n, p in students.items()}
        for a in range(0, len(rows), 64):
            part = rows[a:a + 64]
            seqs = [r["prompt_ids"] + r["response_ids"] for r in part]
            tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.int64)
            for j, s in enumerate(seqs):   # right padding: causal attention keeps it out of earlier positions
                tokens[j, :len(s)] = torch.tensor(s)
            logp = {n: torch.log_softmax(m(**model_inputs(tokens))[..., :V].double(), -1) for n, m in models.items()}
            for name in students:
                kl = (logp["teacher"].exp() * (logp["teacher"] - logp[name])).sum(-1)   # [b, s]
                for j, r in enumerate(part):
                    p, m = len(r["prompt_ids"]), len(r["response_ids"])
                    out[name].append(float(kl[j, p - 1:p - 1 + m].mean()))
    return {n: np.asarray(v) for n, v in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_offline_kd_student_beats_an_sft_student_on_the_same_teacher_samples(tmp_path: Path, sft_checkpoint: Path):
    gen = tmp_path / "teacher_train"
    rows = generate(sft_checkpoint, SYNTH / "prompts.jsonl", gen, "--samples", str(SAMPLES),
                    "--top-k-logprobs", str(K))
    assert len(rows) == 500 * SAMPLES
    kd_data, sft_data = same_samples(rows, tmp_path)
    students = {"kd": train("kd", tmp_path / "kd", f"data.train_path={kd_data}", "loss.options.rest_mass=true"),
                "kd_renormalised": train("kd", tmp_path / "kd_renormalised", f"data.train_path={kd_data}",
                                         "loss.options.rest_mass=false"),
                "sft": train("sft", tmp_path / "sft", f"data.train_path={sft_data}")}
    correct = {n: evaluate(p, tmp_path / f"eval_{n}", *STUDENT) for n, p in students.items()}
    correct["teacher"] = evaluate(sft_checkpoint, tmp_path / "eval_teacher")
    held = generate(sft_checkpoint, SYNTH / "prompts_val.jsonl", tmp_path / "teacher_val", "--samples", "1")
    kl = held_out_kl(sft_checkpoint, students, held)

    verdict: dict = {f"{n}_acc": float(c.mean()) for n, c in correct.items()} | {
        f"{n}_kl": float(v.mean()) for n, v in kl.items()}
    for name in ("kd", "kd_renormalised"):
        acc = paired_counts(correct["sft"], correct[name])
        b, c = int((kl[name] < kl["sft"]).sum()), int((kl[name] > kl["sft"]).sum())
        verdict[name] = {"acc_b": acc.b, "acc_c": acc.c, "acc_p": acc.p_better, "kl_lower": b, "kl_higher": c,
                         "kl_p": sign_test(b, c)}
    print("offline-kd-verdict " + json.dumps(verdict))
    kd = verdict["kd"]
    assert kd["kl_p"] < ALPHA, f"KD's held-out KL to the teacher is not below SFT's: {verdict}"
    assert kd["acc_p"] < ALPHA, f"KD's held-out exact accuracy is not above SFT's: {verdict}"
    # the renormalised top-K loss (rest_mass=false) is blind to the mass outside the K ids: it is
    # reported, and only its greedy accuracy is claimed (its full-vocabulary KL was measured above SFT's)
    assert verdict["kd_renormalised"]["acc_p"] < ALPHA, f"renormalised KD's accuracy is not above SFT's: {verdict}"
