"""Data read per rank: each rank reads (and tokenizes) only the rows it uses, from every format;
the login node reads a bounded sample; a row too long for max_seq_len is an error naming the
file, the row and the column (or is cut, data.truncate); mixtures of every data kind draw
their weights' proportions and resume the exact sequence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import PROBE_ROWS, DataOrder, PreferenceDataset, PromptDataset, SFTDataset
from slurm_align.data.jsonl import read_rows
from slurm_align.data.mixture import MixtureSpec
from slurm_align.data.sources import RowSource
from slurm_align.losses.kto import KTODataset
from slurm_align.losses.regression import AttributeDataset
from slurm_align.models.tokenizer import ByteTokenizer

N, GROUP, RANKS, GLOBAL_BATCH = 800, 100, 8, 80


def _sft_table(n: int, tag: str = "") -> pa.Table:
    return pa.table({"q": [f"{tag}{i:04d}=" for i in range(n)], "a": [f"{i % 97}" for i in range(n)],
                     "label": [i % 3 == 0 for i in range(n)], "helpfulness": [float(i % 5) for i in range(n)]})


def _write(tmp_path: Path, fmt: str, table: pa.Table, name: str = "d") -> Path:
    if fmt == "jsonl":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in table.to_pylist()))
    elif fmt == "parquet":
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=GROUP)
    elif fmt == "arrow":
        path = tmp_path / f"{name}.arrow"
        feather.write_feather(table, path)
    else:
        path = tmp_path / f"{name}_disk"
        datasets.Dataset(table).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow", "hf_disk"])
def test_a_rank_reads_and_tokenizes_only_its_share(tmp_path: Path, fmt: str):
    """Rank 3 of 8 trains step 0's 10 rows: it reads and tokenizes those (and the PROBE_ROWS
    first rows, where the chat template is tried), not the 800; its batch equals the one an
    eager read of the whole file gives."""
    path = _write(tmp_path, fmt, _sft_table(N))
    cols = {"input": "q", "output": "a"}
    tok = ByteTokenizer()
    ds = SFTDataset(path, tok, 64, cols)
    idx = DataOrder(len(ds), GLOBAL_BATCH, seed=5).rank_indices(0, 3, RANKS)
    got = ds.batch(idx)
    source: RowSource = ds.rows.source   # type: ignore[attr-defined]
    assert len(ds) == N
    assert ds.items.encoded == len(idx) == GLOBAL_BATCH // RANKS
    assert source.reads <= len(idx) + PROBE_ROWS, f"{source.reads} rows read for a share of {len(idx)}"
    if fmt == "parquet":   # the row groups of its rows (and of the probe), not all 8
        groups = {i // GROUP for i in [*idx, *range(PROBE_ROWS)]}
        assert source.groups_read <= len(groups) < N // GROUP   # type: ignore[attr-defined]
    eager = read_rows(path, "SFT", cols)
    want = [tok.encode(eager[i].data["input"]) + tok.encode(eager[i].data["output"]) for i in idx]
    assert [got["tokens"][k, 1:got["lengths"][k] - 1].tolist() for k in range(len(idx))] == want


def test_the_login_node_reads_a_bounded_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """check_prompt_lengths reads CHECKED_PROMPTS rows of a 20,000-row file, not all of it."""
    from slurm_align.config import load_run_config
    from slurm_align.config.loading import CHECKED_PROMPTS, check_prompt_lengths

    reads = []
    real = RowSource.record
    monkeypatch.setattr(RowSource, "record", lambda self, i: reads.append(i) or real(self, i))
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"q": f"{i % 1000:03d}="}) + "\n" for i in range(20_000)))
    run = load_run_config(Path(__file__).resolve().parents[3] / "examples" / "grpo_tiny.yaml",
                          ["data.columns={prompt: q}"])
    check_prompt_lengths(run, path)
    assert len(reads) == len(set(reads)) == CHECKED_PROMPTS


def test_rows_too_long_name_file_row_and_column_or_are_cut_when_asked(tmp_path: Path):
    tok = ByteTokenizer()
    prompts = _write(tmp_path, "parquet", pa.table({"question": ["1=", "2=", "9" * 40 + "=", "3="]}), "p")
    ds = PromptDataset(prompts, tok, 64, {"prompt": "question"}, reserve=32)
    assert ds.token_arrays()[1].tolist() == [tok.bos_id, *tok.encode("2=")], "rows that fit read as before"
    with pytest.raises(ConfigError, match=r"p\.parquet.*row 2: the prompt \('prompt'\) has more than 32 tokens.*"
                                          r"max_new_tokens=32.*key 'prompt' is column 'question'"):
        ds.token_arrays()[2]

    sft = tmp_path / "s.jsonl"
    sft.write_text(json.dumps({"q": "1=", "a": "1"}) + "\n\n" + json.dumps({"q": "2=", "a": "5" * 80}) + "\n")
    cols = {"input": "q", "output": "a"}
    with pytest.raises(ConfigError, match=r"s\.jsonl.*line 3: longer than model.max_seq_len=64 tokens "
                                          r"\('input', 'output'\).*data.truncate=true.*key 'input' is column 'q'"):
        SFTDataset(sft, tok, 64, cols).batch([1])
    cut = SFTDataset(sft, tok, 64, cols, truncate=True).batch([0, 1])
    assert cut["lengths"].tolist() == [5, 64], "data.truncate: cut to max_seq_len"

    pref = tmp_path / "r.jsonl"
    pref.write_text(json.dumps({"prompt": "x=", "chosen": "1", "rejected": "2" * 70}) + "\n")
    with pytest.raises(ConfigError, match=r"r\.jsonl.*line 1: longer than model.max_seq_len=64"):
        PreferenceDataset(pref, tok, 64).batch([0])
    assert PreferenceDataset(pref, tok, 64, truncate=True).batch([0])["lengths"].tolist() == [5, 64]


KINDS = {
    "SFT": lambda spec, tok: SFTDataset(spec, tok, 64, {"input": "q", "output": "a"}),
    "preference": lambda spec, tok: PreferenceDataset(spec, tok, 64, {"prompt": "q", "chosen": "a", "rejected": "r"}),
    "KTO": lambda spec, tok: KTODataset(spec, tok, 64, {"input": "q", "output": "a"}),
    "attributes": lambda spec, tok: AttributeDataset(spec, tok, 64, ["helpfulness"],
                                                     columns={"input": "q", "output": "a"}),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_mixtures_of_every_kind_draw_their_weights_and_resume_the_exact_sequence(tmp_path: Path, kind: str):
    """Sources at 0.75 / 0.25 (a parquet and a JSONL file): 2,000 mixed positions take the first
    within 4 binomial standard deviations of 1,500; batches of steps 0-5 equal steps 0-2, then
    (fresh objects: a restarted job) steps 3-5."""
    def table(n: int, tag: str) -> pa.Table:
        t = _sft_table(n, tag)
        return t.append_column("r", pa.array([f"{tag}x"] * n))

    a = _write(tmp_path, "parquet", table(300, "a"), "a")
    b = _write(tmp_path, "jsonl", table(100, "b"), "b")
    spec = MixtureSpec([(a, 0.75, None), (b, 0.25, None)], seed=11, length=2000)
    tok = ByteTokenizer()
    ds = KINDS[kind](spec, tok)
    rows = ds.sft.rows if hasattr(ds, "sft") else ds.rows
    assert len(ds) == 2000
    first = sum(rows[j].path == a for j in range(2000))
    assert abs(first - 1500) < 4 * math.sqrt(2000 * 0.75 * 0.25), f"{first} of 2000 from the 0.75 source"

    def batches(steps: range) -> list[dict]:
        fresh = KINDS[kind](spec, tok)
        order = DataOrder(len(fresh), 16, seed=3)
        return [fresh.batch(order.global_indices(s)) for s in steps]

    whole, resumed = batches(range(6)), batches(range(3)) + batches(range(3, 6))
    for w, r in zip(whole, resumed):
        assert w.keys() == r.keys()
        assert all(torch.equal(w[k], r[k]) if not w[k].is_floating_point() else
                   torch.allclose(w[k], r[k], equal_nan=True) for k in w)
    drawn = {bytes(t[1:6].tolist()) for b in whole for t in b["tokens"]}
    assert any(d.startswith(b"a") for d in drawn) and any(d.startswith(b"b") for d in drawn), "both sources"


def test_submit_refuses_an_sft_row_too_long_in_its_sample(tmp_path: Path):
    """check_runnable (every launch's last check) reads a sample of a trainer's rows: one longer
    than model.max_seq_len=32 is refused naming the file, the line and the column; data.truncate
    lets it through."""
    from slurm_align.config import load_profile, load_run_config
    from slurm_align.config.loading import check_runnable

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"q": "1=", "a": "1"}) + "\n" + json.dumps({"q": "2=", "a": "5" * 40}) + "\n")
    over = [f"data.train_path={path}", "data.columns={input: q, output: a}"]
    example = Path(__file__).resolve().parents[3] / "examples" / "sft_tiny.yaml"
    with pytest.raises(ConfigError, match=r"sft\.jsonl.*line 2: longer than model.max_seq_len=32.*column 'a'"):
        check_runnable(load_run_config(example, over), load_profile("local"))
    check_runnable(load_run_config(example, [*over, "data.truncate=true"]), load_profile("local"))
