"""Byte tokenizer and a local HF tokenizer.json, selected by ModelConfig.tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.models.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo=")
    assert max(ids) < 256 and tok.decode([*ids, tok.eos_id, tok.pad_id]) == "héllo="
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    assert isinstance(build_tokenizer(ModelConfig()), ByteTokenizer)
    with pytest.raises(ConfigError, match="vocab_size"):
        build_tokenizer(ModelConfig(vocab_size=100))


def _write_hf(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "[UNK]": 3, "sort": 4, "1": 5, "2": 6, "=": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "</s>", "<s>"])
    tok.save(str(path))
    return path


def test_hf_tokenizer_from_local_file(tmp_path: Path):
    path = _write_hf(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    ids = tok.encode("sort 1 2 =")
    assert ids == [4, 5, 6, 7] and tok.decode([*ids, 1]) == "sort 1 2 ="
    cfg = ModelConfig(tokenizer={"kind": "hf", "path": str(path)})
    assert isinstance(build_tokenizer(cfg), HFTokenizer)


def test_hf_tokenizer_errors_name_the_field(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"model\.tokenizer\.path.*no such file"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"not a tokenizer\.json"):
        HFTokenizer(bad)
