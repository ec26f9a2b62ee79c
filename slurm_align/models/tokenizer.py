"""Tokenizers: the built-in byte-level one (no download) and a local Hugging Face tokenizer.

Both expose: encode(text) -> list[int] (no specials added), decode(ids) -> str (specials
dropped), bos_id, eos_id, pad_id, vocab_size, and apply_chat_template(messages,
add_generation_prompt=...) -> str. bos_id is the token that plain text rows start with, or None
when none is prepended: [BOS] text is then what transformers' `tokenizer(text)` gives.

A Hugging Face tokenizer is a folder (model.hf_path, or model.tokenizer.path) holding
tokenizer.json, and usually tokenizer_config.json (bos/eos/pad tokens, chat_template) and
chat_template.jinja (which, as in transformers, takes priority over the config's template);
model.tokenizer.path may also name the tokenizer.json itself, whose folder is then read.
Special tokens:
  - with tokenizer_config.json (or the legacy special_tokens_map.json): its bos_token,
    eos_token, pad_token, ... exactly; eos_token is required (SFT appends it, generation stops
    at it); pad_token falls back to eos_token (what transformers users set; padding is always
    masked out); BOS is prepended when tokenizer.json's post-processor adds it (Llama 3: yes;
    Qwen2, GPT-2: no), as transformers' `tokenizer(text)` does;
  - a bare tokenizer.json: found by their usual names (<s>, </s>, <|endoftext|>, ...); a BOS
    found is prepended.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import jinja2
from tokenizers import Tokenizer as _RustTokenizer

from slurm_align.config.errors import ConfigError
from slurm_align.config.run import ModelConfig
from slurm_align.models.chat_template import compile_template, render_chat

Messages = list[dict[str, Any]]


class Tokenizer(Protocol):
    # read-only (properties): ByteTokenizer's class constants satisfy them as HFTokenizer's fields do
    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus BOS=256, EOS=257, PAD=258 (vocab 259). No chat template."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 259
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> str:
        raise ConfigError.at("model.tokenizer.kind", "byte",
                             "the byte tokenizer has no chat template; chat rows ({\"messages\": ...}) need a "
                             "Hugging Face tokenizer with one (model.hf_path, or model.tokenizer kind 'hf')")


# Names that a bare tokenizer.json (no tokenizer_config.json) uses for its special tokens.
_BOS = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")
_EOS = ("</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "[SEP]")
_PAD = ("<pad>", "<|pad|>", "[PAD]")
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the ones a template sees.
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path, field: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError.at(field, str(path), f"cannot read it as JSON ({e})", path) from None
    if not isinstance(data, dict):
        raise ConfigError.at(field, str(path), f"expected a JSON object, got {type(data).__name__}", path)
    return data


class HFTokenizer:
    """A local Hugging Face tokenizer through the `tokenizers` package (never fetched from a hub)."""

    def __init__(self, path: str | Path, field: str = "model.tokenizer.path"):
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError.at(field, str(path), "no such file (a local tokenizer.json, or a folder holding one)")
        try:
            self._tok = _RustTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise ConfigError.at(field, str(file), f"not a tokenizer.json ({e})") from None
        self.source = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file, field) if config_file.is_file() else {}
        legacy_file = folder / "special_tokens_map.json"
        legacy = _read_json(legacy_file, field) if legacy_file.is_file() else {}
        if config_file.is_file() or legacy_file.is_file():
            self._named_tokens(config, legacy, config_file if config_file.is_file() else legacy_file, field)
        else:
            self._guessed_tokens(field)
        self.chat_template = self._template(folder, config, field)

    def _named_tokens(self, config: dict, legacy: dict, source: Path, field: str) -> None:
        """Special tokens as tokenizer_config.json (else special_tokens_map.json) names them."""
        self.special_tokens: dict[str, str] = {}
        for name in _NAMED:
            text = _token_text(config.get(name, legacy.get(name)))
            if text is not None:
                self.special_tokens[name] = text
        ids: dict[str, int | None] = {}
        for name in ("bos_token", "eos_token", "pad_token"):
            text = self.special_tokens.get(name)
            ids[name] = None if text is None else self._tok.token_to_id(text)
            if text is not None and ids[name] is None:
                raise ConfigError.at(f"{name}", text, f"is not a token of {self.source}", source)
        if ids["eos_token"] is None:
            raise ConfigError(["no eos_token: a run needs an end-of-sequence token (SFT data ends with it, "
                               "generation stops at it); set eos_token to one of the tokenizer's tokens"], source)
        self.eos_id = ids["eos_token"]
        self.bos_id = ids["bos_token"] if self._post_processor_adds(ids["bos_token"]) else None
        self.pad_id = self.eos_id if ids["pad_token"] is None else ids["pad_token"]

    def _post_processor_adds(self, bos: int | None) -> bool:
        """Whether encoding with special tokens puts `bos` before the text."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        return bos is not None and full[:1] == [bos] and full[1: 1 + len(plain)] == plain

    def _guessed_tokens(self, field: str) -> None:
        """A bare tokenizer.json: special tokens by their usual names."""
        eos = self._find(_EOS)
        if eos is None:
            raise ConfigError.at(field, self.source,
                                 f"has no end-of-sequence token; expected one of {', '.join(_EOS)} "
                                 f"(or a tokenizer_config.json beside it naming eos_token)")
        bos, pad = self._find(_BOS), self._find(_PAD)
        self.eos_id, self.bos_id = eos, bos
        self.pad_id = eos if pad is None else pad
        found = (("bos_token", bos), ("eos_token", eos), ("pad_token", pad))
        # ids _find took from the vocabulary: each has its text
        self.special_tokens = {name: text for name, i in found
                               if i is not None and (text := self._tok.id_to_token(i)) is not None}

    def _find(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    @staticmethod
    def _template(folder: Path, config: dict, field: str) -> str | None:
        """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list
        of named templates of which 'default' is used, as transformers does)."""
        jinja_file = folder / "chat_template.jinja"
        source, where = config.get("chat_template"), folder / "tokenizer_config.json"
        if jinja_file.is_file():
            source, where = jinja_file.read_text(encoding="utf-8"), jinja_file
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ConfigError.at("chat_template", sorted(map(str, named)),
                                     "several chat templates but none named 'default'", where)
            source = named["default"]
        if source is None:
            return None
        if not isinstance(source, str):
            raise ConfigError.at("chat_template", type(source).__name__, "must be a Jinja template string", where)
        try:
            compile_template(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError.at("chat_template", f"line {e.lineno}", f"not a valid Jinja template ({e.message})",
                                 where) from None
        return source

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: Messages, *, add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation rendered as transformers' apply_chat_template(tokenize=False) renders
        it; `tools`: tool schemas for templates that describe tools (Qwen2.5, Llama 3.1)."""
        if self.chat_template is None:
            raise ConfigError(["this tokenizer has no chat template (no chat_template in tokenizer_config.json, "
                               "no chat_template.jinja); chat rows ({\"messages\": ...}) need one"], self.source)
        return render_chat(self.chat_template, messages, self.special_tokens,
                           add_generation_prompt=add_generation_prompt, tools=tools)


def build_tokenizer(model_cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of model.hf_path when set (unless model.tokenizer names an HF tokenizer
    explicitly), else the one model.tokenizer chooses."""
    tc = model_cfg.tokenizer
    hf_path = getattr(model_cfg, "hf_path", None)
    tok: Tokenizer
    if tc.kind == "hf":
        assert tc.path is not None, "TokenizerConfig: kind 'hf' needs a path"
        tok = HFTokenizer(tc.path)
    elif hf_path is not None:
        tok = HFTokenizer(hf_path, field="model.hf_path")
    else:
        tok = ByteTokenizer()
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError.at("model.vocab_size", model_cfg.vocab_size,
                             f"the tokenizer ({getattr(tok, 'source', 'byte')}) has {tok.vocab_size} tokens; "
                             f"vocab_size must be at least that")
    return tok
