"""Data as users bring it: parquet, Arrow and save_to_disk folders with their own column names
read as the JSONL files are; bad files name the file, the row and the column; rows are encoded
only when used."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from slurm_align.config.errors import ConfigError
from slurm_align.data.datasets import PreferenceDataset, PromptDataset, SFTDataset
from slurm_align.data.jsonl import read_rows
from slurm_align.models.tokenizer import ByteTokenizer

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "synthetic"


def _jsonl_rows(name: str, n: int = 40) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines()[:n]]


def _write_all_formats(tmp_path: Path, table: pa.Table) -> dict[str, Path]:
    """The same table as parquet, Arrow IPC file (feather v2), and a save_to_disk folder."""
    paths = {"parquet": tmp_path / "d.parquet", "arrow": tmp_path / "d.arrow", "hf_disk": tmp_path / "d_disk"}
    pq.write_table(table, paths["parquet"])
    feather.write_feather(table, paths["arrow"])
    datasets.Dataset(table).save_to_disk(str(paths["hf_disk"]))
    return paths


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "hf_disk"])
def test_sort_prompts_with_other_column_names_give_the_jsonl_prompts_and_fields(tmp_path: Path, fmt: str):
    """The sort task's prompts under the user's column names ('question', with a 'gold' field)
    give the same token arrays and reward fields as the JSONL file: rollouts, a function of
    these and the seed, are then the same."""
    rows = [{**r, "answer": "".join(sorted(r["prompt"][:-1]))} for r in _jsonl_rows("prompts.jsonl")]
    ref = tmp_path / "ref.jsonl"
    ref.write_text("".join(json.dumps(r) + "\n" for r in rows))
    theirs = pa.table({"id": list(range(len(rows))), "question": [r["prompt"] for r in rows],
                       "gold": [r["answer"] for r in rows]})
    path = _write_all_formats(tmp_path, theirs)[fmt]
    tok = ByteTokenizer()
    want = PromptDataset(ref, tok, 64)
    got = PromptDataset(path, tok, 64, columns={"prompt": "question", "answer": "gold"})
    assert len(got) == len(want) == 40
    assert all(np.array_equal(a, b) for a, b in zip(got.token_arrays()[:], want.token_arrays()[:]))
    assert [{k: f[k] for k in ("prompt", "answer")} for f in got.fields()] == list(want.fields())
    assert [f["id"] for f in got.fields()] == list(range(40)), "other columns ride along for the reward"
    # What submit reads (config.loading.check_prompt_lengths): the same rows under our keys. With
    # the two readers equal, a job reads every format as it reads the JSONL file
    # (tests/integration/test_data_formats.py runs GRPO on the parquet file end to end).
    submitted = read_rows(path, "prompt", {"prompt": "question", "answer": "gold"})
    assert [{"prompt": r.data["prompt"], "answer": r.extra["answer"]} for r in submitted] == list(want.fields())


def test_sft_and_preference_rows_from_parquet_with_a_column_map(tmp_path: Path):
    tok = ByteTokenizer()
    sft = _jsonl_rows("sft_train.jsonl", 20)
    pq.write_table(pa.table({"q": [r["input"] for r in sft], "a": [r["output"] for r in sft]}), tmp_path / "s.parquet")
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    got = SFTDataset(tmp_path / "s.parquet", tok, 64, columns={"input": "q", "output": "a"})
    want = SFTDataset(tmp_path / "s.jsonl", tok, 64)
    for key in ("tokens", "lengths", "mask"):
        assert got.batch(list(range(20)))[key].tolist() == want.batch(list(range(20)))[key].tolist()

    pref = _jsonl_rows("pref_train.jsonl", 20)
    pq.write_table(pa.table({"x": [r["prompt"] for r in pref], "good": [r["chosen"] for r in pref],
                             "bad": [r["rejected"] for r in pref]}), tmp_path / "p.parquet")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pref))
    got_p = PreferenceDataset(tmp_path / "p.parquet", tok, 64, columns={"prompt": "x", "chosen": "good",
                                                                         "rejected": "bad"})
    want_p = PreferenceDataset(tmp_path / "p.jsonl", tok, 64)
    assert got_p.batch(list(range(20)))["tokens"].tolist() == want_p.batch(list(range(20)))["tokens"].tolist()


def test_chat_rows_from_arrow_read_as_the_jsonl_ones(tmp_path: Path):
    """A list<struct<role, content>> column is a chat row's messages, as a JSONL list is."""
    convs = [[{"role": "user", "content": f"hi {i}"}] for i in range(3)]
    replies = [f"reply {i}" for i in range(3)]
    table = pa.table({"conversation": convs, "good": replies, "bad": ["no"] * 3})
    path = _write_all_formats(tmp_path, table)["arrow"]
    rows = read_rows(path, "preference", {"messages": "conversation", "chosen": "good", "rejected": "bad"})
    assert [r.data["messages"] for r in rows] == convs
    assert [r.data["chosen"] for r in rows] == [[{"role": "assistant", "content": t}] for t in replies]
    assert [r.where for r in rows] == ["row 0", "row 1", "row 2"]


def test_a_rank_encodes_only_the_rows_it_uses(tmp_path: Path):
    """Nothing is tokenized when the data set is opened; each used row once."""
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"{i}=" for i in range(1000)]}), path)
    ds = PromptDataset(path, ByteTokenizer(), 64)
    assert ds.items.encoded == 0
    prompts = ds.token_arrays()
    mine = [prompts[i] for i in (3, 500, 3, 999)]
    assert ds.items.encoded == 3
    assert mine[1].tolist() == [256, *b"500="]
    assert ds.items.encoded == 3


def _error(path: Path, kind: str = "prompt", columns: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        read_rows(path, kind, columns)
    msg = str(info.value)
    assert str(path) in msg, f"the error names the file: {msg}"
    return msg


def test_bad_files_name_the_file_row_column_and_what_is_allowed(tmp_path: Path):
    pq.write_table(pa.table({"question": ["a=", "b="]}), tmp_path / "q.parquet")
    msg = _error(tmp_path / "q.parquet", columns={"prompt": "query"})
    assert "'query'" in msg and "'prompt'" in msg and "['question']" in msg

    msg = _error(tmp_path / "q.parquet")   # no map: the prompt key is missing in every row
    assert "row 0" in msg and "'prompt'" in msg

    pq.write_table(pa.table({"prompt": [1, 2]}), tmp_path / "int.parquet")
    msg = _error(tmp_path / "int.parquet")
    assert "column 'prompt'" in msg and "int64" in msg and "allowed: string" in msg

    pq.write_table(pa.table({"q": ["a=", None, "c="]}), tmp_path / "null.parquet")
    msg = _error(tmp_path / "null.parquet", columns={"prompt": "q"})
    assert "row 1" in msg and "column 'q'" in msg and "null" in msg

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    assert "empty" in _error(tmp_path / "empty.parquet")

    (tmp_path / "d.csv").write_text("prompt\na=\n")
    msg = _error(tmp_path / "d.csv")
    assert "'.csv'" in msg and ".parquet" in msg and "save_to_disk" in msg

    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    assert "cannot read prompt data as parquet" in _error(tmp_path / "broken.parquet")

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a="]})}).save_to_disk(
        str(tmp_path / "dd"))
    assert "train" in _error(tmp_path / "dd") and "one split" in _error(tmp_path / "dd")

    msg = _error(tmp_path / "openai" / "gsm8k")
    assert "not found" in msg and "save_to_disk" in msg, "a hub id is refused, with the way to make it local"

    (tmp_path / "j.jsonl").write_text('{"question": "a="}\n{"q": "b="}\n')
    msg = _error(tmp_path / "j.jsonl", columns={"prompt": "question"})
    assert "line 2" in msg and "'question'" in msg


def test_submit_tokenizes_a_sample_of_a_large_prompt_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The login node reads every row but tokenizes at most CHECKED_PROMPTS of them (a 10k-row
    set costs it the tokenization of a 2,000-row one), and still names a long prompt it drew."""
    from slurm_align.config import load_run_config
    from slurm_align.config.loading import CHECKED_PROMPTS, check_prompt_lengths
    from slurm_align.data import datasets as ds

    calls = []
    real = ds.encode_prompt
    monkeypatch.setattr(ds, "encode_prompt", lambda tok, text, n: calls.append(text) or real(tok, text, n))
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"q": [f"{i % 1000:03d}=" for i in range(10_000)]}), path)
    run = load_run_config(EXAMPLES.parent / "grpo_tiny.yaml", ["data.columns={prompt: q}"])
    check_prompt_lengths(run, path)
    assert len(calls) == CHECKED_PROMPTS
    calls.clear()
    small = tmp_path / "small.parquet"
    pq.write_table(pa.table({"q": ["1=", "2=", "9" * 40 + "="]}), small)
    with pytest.raises(ConfigError, match=r"the longest prompt \(row 2\) has 42 tokens"):
        check_prompt_lengths(run, small)
    assert len(calls) == 3
