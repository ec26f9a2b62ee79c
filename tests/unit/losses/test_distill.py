"""Offline knowledge distillation (losses/distill.py), in this process on a one-rank world: the
loss of a micro-batch built from stored rows against a float64 hand computation from the rows
themselves (so the top-K's alignment with the response is checked too), bad rows refused by
name, and a learning check: a smaller student trained by KD on an SFT-trained teacher's top-K
gets closer to the teacher (full-vocabulary KL per held-out prompt) than before training and
than a twin trained on shuffled teacher targets (sign tests per held-out prompt)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slurm_align import REPO_ROOT
from slurm_align.algorithms.generate import add_top_k
from slurm_align.algorithms.trainer import Trainer
from slurm_align.analysis.significance import sign_test
from slurm_align.config.errors import ConfigError
from slurm_align.config.run import RunConfig
from slurm_align.data.datasets import SFTDataset
from slurm_align.losses.distill import KD, DistillDataset
from slurm_align.losses.registry import KDOptions, loss_spec
from slurm_align.models.forward import per_sequence
from slurm_align.models.tokenizer import build_tokenizer
from tests.support.single_rank import single_rank_world

SYNTH = REPO_ROOT / "examples" / "synthetic"
TEACHER = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 260, "max_seq_len": 32}
STUDENT = {**TEACHER, "hidden_size": 32}
K = 8


@pytest.fixture(scope="module")
def pctx() -> Iterator:
    with single_rank_world() as (_, p):
        yield p


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_loss_is_the_renormalised_top_k_forward_kl_plus_the_sft_term(pctx, tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    V, rows = 260, []
    for n, (p, m) in enumerate([(3, 4), (5, 2), (2, 6)]):
        ids = [torch.randperm(V, generator=g)[:K].tolist() for _ in range(m)]
        rows.append({"prompt_ids": torch.randint(0, V, (p,), generator=g).tolist(),
                     "response_ids": torch.randint(0, V, (m,), generator=g).tolist(), "topk_ids": ids,
                     "topk_logprobs": (-torch.rand(m, K, generator=g) * 5).tolist(), "index": n})
    ds = DistillDataset(write_rows(tmp_path / "kd.jsonl", rows), build_tokenizer(RunConfig(
        algorithm="kd", model=TEACHER).model), 32)
    mb = ds.batch([0, 1, 2])
    mb["real"], mb["norm"] = torch.ones(3), 7.0
    logits = torch.randn(3, mb["tokens"].shape[1], V, generator=g, dtype=torch.float64)
    opts = KDOptions(kd_weight=0.7, sft_weight=0.3, rest_mass=False)
    loss, sums = KD(opts, type("M", (), {"vocab_size": V}))(logits.float().requires_grad_(), mb)

    want_kl = want_nll = 0.0
    for j, r in enumerate(rows):   # by hand, from the rows as stored
        p, seq = len(r["prompt_ids"]), r["prompt_ids"] + r["response_ids"]
        for t in range(len(r["response_ids"])):
            z = logits[j, p - 1 + t].tolist()
            lse = math.log(sum(math.exp(x) for x in z))
            s = [z[i] - lse for i in r["topk_ids"][t]]
            qs = r["topk_logprobs"][t]
            ls, lq = math.log(sum(map(math.exp, s))), math.log(sum(map(math.exp, qs)))
            want_kl += sum(math.exp(q - lq) * ((q - lq) - (x - ls)) for q, x in zip(qs, s))
            want_nll += -(z[seq[p + t]] - lse)
    tokens = sum(len(r["response_ids"]) for r in rows)
    assert float(sums["tokens"]) == tokens
    assert float(sums["kl_sum"]) == pytest.approx(want_kl, rel=1e-5)
    assert float(sums["nll_sum"]) == pytest.approx(want_nll, rel=1e-5)
    assert float(loss) * 7.0 == pytest.approx(0.7 * want_kl + 0.3 * want_nll, rel=1e-5)
    assert want_kl > 0.1, "the test's distributions differ"


def test_with_rest_mass_the_kl_is_over_the_k_ids_and_the_rest_unrenormalised(pctx, tmp_path: Path):
    """Teacher rows from a real distribution's top-K (as generate stores them); the KL over K+1
    classes by hand in float64: the K probabilities as they are, plus 1 - their sum (the teacher)
    and the student's mass on every other id."""
    g = torch.Generator().manual_seed(1)
    V, rows = 260, []
    for p, m in [(3, 4), (4, 3)]:
        teacher = torch.log_softmax(torch.randn(m, V, generator=g, dtype=torch.float64) * 3, -1)
        vals, ids = teacher.topk(K, -1)
        rows.append({"prompt_ids": torch.randint(0, V, (p,), generator=g).tolist(),
                     "response_ids": torch.randint(0, V, (m,), generator=g).tolist(), "topk_ids": ids.tolist(),
                     "topk_logprobs": vals.tolist()})
    ds = DistillDataset(write_rows(tmp_path / "kd.jsonl", rows), build_tokenizer(RunConfig(
        algorithm="kd", model=TEACHER).model), 32)
    mb = ds.batch([0, 1])
    mb["real"], mb["norm"] = torch.ones(2), 1.0
    logits = torch.randn(2, mb["tokens"].shape[1], V, generator=g, dtype=torch.float64)
    _, sums = KD(KDOptions(rest_mass=True), type("M", (), {"vocab_size": V}))(logits.float(), mb)
    want = renormalised = 0.0
    for j, r in enumerate(rows):
        p = len(r["prompt_ids"])
        for t in range(len(r["response_ids"])):
            student = torch.log_softmax(logits[j, p - 1 + t], -1)
            ids, q = r["topk_ids"][t], [math.exp(v) for v in r["topk_logprobs"][t]]
            s = [math.exp(float(student[i])) for i in ids]
            q_rest, s_rest = 1 - sum(q), sum(math.exp(float(student[i])) for i in range(V) if i not in ids)
            want += sum(a * math.log(a / b) for a, b in zip(q, s)) + q_rest * math.log(q_rest / s_rest)
            renormalised += sum(a / sum(q) * math.log(a / sum(q) / (b / sum(s))) for a, b in zip(q, s))
    assert float(sums["kl_sum"]) == pytest.approx(want, rel=1e-5)
    assert abs(want - renormalised) > 0.1, "the test tells the two losses apart"


def test_rows_without_top_k_or_with_mismatched_lengths_are_refused_by_row(tmp_path: Path):
    tok = build_tokenizer(RunConfig(algorithm="kd", model=TEACHER).model)
    good = {"prompt_ids": [1, 2], "response_ids": [3, 4], "topk_ids": [[3, 5], [4, 6]],
            "topk_logprobs": [[-0.1, -2.0], [-0.2, -3.0]]}
    bad = write_rows(tmp_path / "bad.jsonl", [good, {**good, "topk_ids": None}, {**good, "topk_ids": [[3, 5]]},
                                              {**good, "topk_ids": [[3], [4]], "topk_logprobs": [[-0.1], [-0.2]]}])
    ds = DistillDataset(bad, tok, 32)   # rows are read when used: each bad one is named then
    assert ds.batch([0])["topk_ids"].shape == (1, 3, 2)
    for i, message in ((1, r"bad.jsonl: line 2: no \['topk_ids'\]"), (2, r"bad.jsonl: line 3: topk_ids \(1, 2\)"),
                       (3, r"bad.jsonl: line 4: K=1, the first row has K=2")):
        with pytest.raises(ConfigError, match=message):
            ds.batch([0, i])
    with pytest.raises(ConfigError, match=r"bad.jsonl: line 1: no \['topk_ids'\]"):
        DistillDataset(write_rows(tmp_path / "bad.jsonl", [{**good, "topk_ids": None}]), tok, 32)
    with pytest.raises(ValueError, match="nothing would train"):
        loss_spec("kd").parse_options({"kd_weight": 0})


def test_generate_shards_and_a_mixture_of_them_are_read_lazily_row_by_row(tmp_path: Path):
    """generate's shard folder: its files in shard order, a row read only when used; data.mixture
    (a MixtureSpec) of a folder and a file: the mixture's positions (data/mixture.py)."""
    from slurm_align.data.mixture import Mixture, MixtureSpec

    tok = build_tokenizer(RunConfig(algorithm="kd", model=TEACHER).model)
    def row(n: int) -> dict:
        return {"prompt_ids": [1, n], "response_ids": [n], "topk_ids": [[n, 7]], "topk_logprobs": [[-0.1, -2.0]]}
    out = tmp_path / "generate"
    out.mkdir()
    for shard, ns in ((1, [13, 14]), (0, [10, 11, 12])):
        write_rows(out / f"shard_{shard:05d}.jsonl", [row(n) for n in ns])
    ds = DistillDataset(out, tok, 32)
    assert len(ds) == 5 and [ds.item(i).ids[1] for i in range(5)] == [10, 11, 12, 13, 14]
    fresh = DistillDataset(out, tok, 32)
    fresh.batch([3])
    assert [src.reads for src in fresh.rows.sources] == [1, 1], "the first row (K) and the one used"

    other = write_rows(tmp_path / "other.jsonl", [row(20 + n) for n in range(4)])
    spec = MixtureSpec([(out, 0.5, None), (other, 0.5, None)], seed=3, length=12)
    mixed = DistillDataset(spec, tok, 32)
    mix = Mixture([5, 4], [0.5, 0.5], 3, 12)
    want = [[10, 11, 12, 13, 14], [20, 21, 22, 23]]
    assert [mixed.item(j).ids[1] for j in range(12)] == [want[s][r] for s, r in zip(mix.source, mix.row)]
    assert mixed.batch([0, 5])["topk_ids"][:, 1, 0].tolist() == [mixed.item(0).ids[1], mixed.item(5).ids[1]]


def teacher_rows(teacher, pctx, ds: SFTDataset) -> list[dict]:
    """generate's rows for the data set's own responses, top-K from the teacher (add_top_k)."""
    rows = [{"index": i, "prompt_ids": s.ids[:s.prompt_len], "response_ids": s.ids[s.prompt_len:]}
            for i, s in enumerate(ds.items)]
    add_top_k(teacher.worker.chunks, pctx, rows, K, TEACHER["vocab_size"], 64)
    return rows


def held_out_kl(teacher, student, ds: SFTDataset) -> torch.Tensor:
    """Per held-out row: the mean over its response tokens of the full-vocabulary KL(teacher || student)."""
    def logp(output, mb):
        return {"logp": torch.log_softmax(per_sequence(output, mb)[:, :-1].double(), -1), "mask": mb["mask"]}
    idx = list(range(len(ds)))
    t, s = teacher.worker.forward(ds, idx, logp), student.worker.forward(ds, idx, logp)
    assert torch.equal(t["index"], s["index"])
    kl = (t["logp"].exp() * (t["logp"] - s["logp"])).sum(-1)
    return (kl * s["mask"]).sum(-1) / s["mask"].sum(-1)


def test_kd_brings_a_smaller_student_closer_to_the_teacher_than_before_and_than_a_shuffled_twin(
        pctx, tmp_path: Path):
    trainer = {"global_batch_size": 32, "micro_batch_size": 32, "lr": 3e-3, "num_steps": 40}
    teacher = Trainer(RunConfig(algorithm="sft", model=TEACHER, seed=3, trainer=trainer,
                                data={"train_path": SYNTH / "sft_train.jsonl"}), pctx, tmp_path / "teacher")
    for step in range(40):
        teacher.train_step(step)
    tok = build_tokenizer(teacher.run.model)
    train = SFTDataset(SYNTH / "sft_train.jsonl", tok, 32)
    val = SFTDataset(SYNTH / "sft_val.jsonl", tok, 32)
    rows = teacher_rows(teacher, pctx, train)[:640]
    shuffled = [dict(r) for r in rows]
    perm = random.Random(0).sample(range(len(rows)), len(rows))   # another row's targets, cut or padded to length
    for r, other in zip(shuffled, (rows[i] for i in perm)):
        m = len(r["response_ids"])
        ids, lps = other["topk_ids"][:m], other["topk_logprobs"][:m]
        r["topk_ids"], r["topk_logprobs"] = ids + ids[-1:] * (m - len(ids)), lps + lps[-1:] * (m - len(lps))
    kls = {}
    for name, data in (("kd", rows), ("shuffled", shuffled)):
        student = Trainer(RunConfig(algorithm="kd", model=STUDENT, seed=5, trainer=trainer,
                                    data={"train_path": write_rows(tmp_path / f"{name}.jsonl", data)}),
                          pctx, tmp_path / name)
        assert type(student.loss).__name__ == "KD"
        if name == "kd":
            kls["before"] = held_out_kl(teacher, student, val)
        for step in range(20):
            student.train_step(step)
        kls[name] = held_out_kl(teacher, student, val)
    kd, before, shuffled_kl = kls["kd"], kls["before"], kls["shuffled"]
    assert sign_test(int((kd < before).sum()), int((kd > before).sum())) < 1e-3, (kd.mean(), before.mean())
    assert sign_test(int((kd < shuffled_kl).sum()), int((kd > shuffled_kl).sum())) < 1e-3, \
        (kd.mean(), shuffled_kl.mean())
