"""Tokenizers: the built-in byte-level one (no download) and any local HF tokenizer.json.

Both expose: encode(text) -> list[int] (no specials), decode(ids) -> str (specials dropped),
bos_id, eos_id, pad_id, vocab_size. Chosen by ModelConfig.tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus BOS=256, EOS=257, PAD=258 (vocab 259)."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


_BOS = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS = ("</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_PAD = ("<pad>", "<|pad|>", "[PAD]")


class HFTokenizer:
    """A local tokenizer.json through the `tokenizers` package (never fetched from a hub)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok
        path = Path(path)
        if not path.is_file():
            raise ConfigError.at("model.tokenizer.path", str(path), "no such file (a local tokenizer.json)")
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError.at("model.tokenizer.path", str(path), f"not a tokenizer.json ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find(_EOS)
        if self.eos_id is None:
            raise ConfigError.at("model.tokenizer.path", str(path),
                                 f"has no end-of-sequence token; expected one of {', '.join(_EOS)}")
        bos, pad = self._find(_BOS), self._find(_PAD)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = self.eos_id if pad is None else pad

    def _find(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(model_cfg: ModelConfig) -> Tokenizer:
    tc = model_cfg.tokenizer
    tok = ByteTokenizer() if tc.kind == "byte" else HFTokenizer(tc.path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError.at("model.vocab_size", model_cfg.vocab_size,
                             f"the {tc.kind} tokenizer has {tok.vocab_size} tokens; vocab_size must be at least that")
    return tok
