"""Data rows with errors that name the file, the line (or row) and what is wrong.

Rows come from JSONL, parquet, Arrow or a datasets save_to_disk folder, with an optional column
map (data/sources.py); each row, written here as a JSONL line, is a plain row (as NeMo-Aligner
users know them) or a chat row (a conversation as transformers' apply_chat_template takes it,
rendered with the tokenizer's chat template):

    prompts      {"prompt": str}
                 {"messages": [turn, ...]}                 the last turn is not the assistant's
    SFT          {"input": str, "output": str}
                 {"input": str, "output": [segment, ...]}  a multi-turn answer: each segment is
                                                           {"role": str, "content": str}; only the
                                                           "assistant" segments are trained, the
                                                           others (tool results, ...) are context
                 {"messages": [turn, ..., assistant turn]} every assistant turn is trained, the
                                                           turns before the first are the prompt,
                                                           those between (tool results, user
                                                           turns) are context
    preferences  {"prompt": str, "chosen": str, "rejected": str}
                 {"messages": [prompt turn, ...], "chosen": R, "rejected": R}
                 where R is the assistant's reply as a string, as one assistant message, or as a
                 list of messages that continue the conversation.

A turn is {"role": str, "content": str, ...} (other keys go to the template as they are). A row
with "messages" is a chat row. Extra keys are allowed and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence as CollectionSequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_align.config.errors import ConfigError
from slurm_align.data.sources import RowSource, _NotJson, open_source, records

SFT_KEYS = ("input", "output")
PREFERENCE_KEYS = ("prompt", "chosen", "rejected")
PROMPT_KEYS = ("prompt",)
PLAIN_KEYS = {"prompt": PROMPT_KEYS, "SFT": SFT_KEYS, "preference": PREFERENCE_KEYS}
MAX_PROBLEMS = 20
ASSISTANT = "assistant"
"""The role whose text is trained in a multi-turn SFT output; other roles are context only."""


@dataclass(frozen=True)
class Row:
    """One validated line. Plain rows hold their strings; chat rows hold "messages" (the prompt
    turns, plus the response turn for SFT) and, for preferences, "chosen"/"rejected" as lists
    of messages."""

    line: int
    data: dict[str, Any]
    extra: dict[str, Any]
    """The line's other fields (e.g. a rule reward's reference answer), as they are."""
    unit: str = "line"
    """"line" (JSONL, numbered from 1) or "row" (tables, numbered from 0): how errors name it."""
    path: Path | None = None
    """The file the row came from (a mixture's rows come from several)."""
    columns: Mapping[str, str] | None = None
    """The file's column map (data.columns), to name the file's columns in errors."""

    @property
    def where(self) -> str:
        return f"{self.unit} {self.line}"

    @property
    def is_chat(self) -> bool:
        return "messages" in self.data


def _not_object(value: Any, keys: str) -> str:
    if isinstance(value, _NotJson):
        return str(value)
    return f"expected a JSON object with keys {keys}, got {type(value).__name__}"


def _plain_problem(obj: dict, keys: tuple[str, ...], kind: str) -> str | None:
    missing = [k for k in keys if k not in obj]
    if missing:
        return f"missing key(s) {missing} ({kind} lines need {list(keys)}; found {sorted(obj)})"
    segmented = kind == "SFT" and isinstance(obj.get("output"), list)
    wrong = [f"{k!r} is {type(obj[k]).__name__}" for k in keys
             if not isinstance(obj[k], str) and not (segmented and k == "output")]
    if wrong:
        return f"values must be strings: {', '.join(wrong)}"
    if segmented:
        problem = _messages_problem(obj["output"], "output")
        if problem:
            return problem + " (a multi-turn output: a list of segments)"
        if not any(m["role"] == ASSISTANT for m in obj["output"]):
            return f"'output' has no {ASSISTANT!r} segment: nothing to train on"
    return None


def _finish(rows: list, problems: list[str], path: Path, kind: str, expected: str) -> list:
    if problems:
        raise ConfigError(problems[:MAX_PROBLEMS], path)
    if not rows:
        raise ConfigError([f"{kind} data file is empty (expected rows with {expected})"], path)
    return rows


def read_jsonl(path: str | Path, keys: tuple[str, ...], kind: str, keep_extra: bool = False,
               columns: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Plain rows only: every row must be an object with string values for `keys` (any format of
    data/sources.py; `columns` maps our keys to the file's columns).
    keep_extra: a row keeps its other fields too (e.g. a rule reward's reference answer)."""
    path = Path(path)
    rows, problems = [], []
    unit, found = records(path, kind, columns)
    for n, obj in found:
        if isinstance(obj, _NotJson) or not isinstance(obj, dict):
            problems.append(f"{unit} {n}: {_not_object(obj, str(list(keys)))}")
            continue
        problem = _plain_problem(obj, keys, kind)
        if problem:
            problems.append(f"{unit} {n}: {problem}")
        else:
            rows.append(dict(obj) if keep_extra else {k: obj[k] for k in keys})
    return _finish(rows, problems, path, kind, f"keys {list(keys)}")


def _messages_problem(value: Any, key: str) -> str | None:
    if not isinstance(value, list) or not value:
        return f"{key!r} must be a non-empty list of messages, got {json.dumps(value)[:60]}"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"{key}[{i}] must be an object {{\"role\": ..., \"content\": ...}}, got {type(m).__name__}"
        bad = [k for k in ("role", "content") if not isinstance(m.get(k), str)]
        if bad:
            return f"{key}[{i}] needs string {' and '.join(map(repr, bad))} (got keys {sorted(m)})"
    return None


def _as_messages(value: Any) -> Any:
    """A preference reply (string, one message or a list of messages) as a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    return [value] if isinstance(value, dict) else value


def _chat_row(obj: dict, kind: str) -> tuple[dict | None, str | None]:
    """The validated chat row, or what is wrong with it."""
    problem = _messages_problem(obj["messages"], "messages")
    if problem:
        return None, problem
    messages = obj["messages"]
    last = messages[-1]["role"]
    if kind == "SFT":
        if last != "assistant":
            return None, (f"the last message of an SFT chat row is the response and must have role "
                          f"'assistant', got {last!r}")
        return {"messages": messages}, None
    if last == "assistant":
        return None, (f"the last message of a {kind} chat row must be a prompt turn (user, system, ...), "
                      f"not 'assistant'")
    if kind == "prompt":
        return {"messages": messages}, None
    row = {"messages": messages}
    for key in ("chosen", "rejected"):
        if key not in obj:
            return None, f"missing key {key!r} (preference chat rows need 'messages', 'chosen', 'rejected')"
        reply = _as_messages(obj[key])
        problem = _messages_problem(reply, key)
        if problem:
            return None, problem + " (a string, an assistant message, or a list of messages)"
        row[key] = reply
    return row, None


def make_row(n: int, obj: Any, kind: str, unit: str, path: Path | None = None,
             columns: Mapping[str, str] | None = None) -> tuple[Row | None, str | None]:
    """Record `obj` (row number `n`) as a validated Row of `kind`, or what is wrong with it."""
    keys = PLAIN_KEYS[kind]
    if isinstance(obj, _NotJson) or not isinstance(obj, dict):
        return None, f"{unit} {n}: {_not_object(obj, f'{list(keys)} or messages')}"
    if "messages" in obj:
        data, problem = _chat_row(obj, kind)
    else:
        problem = _plain_problem(obj, keys, kind)
        data = None if problem else {k: obj[k] for k in keys}
        if problem:
            problem += " (or a chat row with 'messages')"
    if problem:
        return None, f"{unit} {n}: {problem}"
    assert data is not None, "a row without a problem has its data"
    return Row(n, data, {k: v for k, v in obj.items() if k not in data}, unit, path, columns or None), None


def read_rows(path: str | Path, kind: str, columns: Mapping[str, str] | None = None) -> list[Row]:
    """Plain and chat rows of a `kind` ('prompt', 'SFT' or 'preference') data file, in any
    format of data/sources.py, all read and validated now; `columns` maps our keys to the file's
    columns. (The datasets read lazily: LazyRows.)"""
    path = Path(path)
    rows, problems = [], []
    unit, found = records(path, kind, columns)
    for n, obj in found:
        row, problem = make_row(n, obj, kind, unit)
        if problem:
            problems.append(problem)
        elif row is not None:
            rows.append(row)
    return _finish(rows, problems, path, kind, f"keys {list(PLAIN_KEYS[kind])} or 'messages'")


def column_names(problem: str, columns: Mapping[str, str]) -> str:
    """`problem` with the file's column named beside each mapped key it mentions."""
    named = [f"key {ours!r} is column {theirs!r}" for ours, theirs in columns.items() if repr(ours) in problem]
    return f"{problem} ({'; '.join(named)}, data.columns)" if named else problem


class LazyRows(CollectionSequence):
    """The validated Rows of a data file, each read (data/sources.py: by its line offset, its
    parquet row group, or from the memory-mapped Arrow table) and validated when first asked
    for, then kept: a rank that uses 1/8 of a data set reads 1/8 of its rows. A bad row is an
    error naming the file, the row and the column when it is read."""

    def __init__(self, source: RowSource, kind: str):
        self.source, self.kind, self.path = source, kind, source.path
        self._rows: dict[int, Row] = {}
        if not len(source):
            keys = list(PLAIN_KEYS[kind])
            raise ConfigError([f"{kind} data file is empty (expected rows with keys {keys} or 'messages')"],
                              source.path)

    def __len__(self) -> int:
        return len(self.source)

    @property
    def read(self) -> int:
        """Rows read so far."""
        return len(self._rows)

    def __getitem__(self, i):  # type: ignore[override]  # int -> Row, slice -> list
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        row = self._rows.get(i)
        if row is None:
            if not 0 <= i < len(self):
                raise IndexError(i)
            src = self.source
            row, problem = make_row(src.number(i), src.record(i), self.kind, src.unit, src.path, src.columns)
            if problem:
                raise ConfigError([column_names(problem, src.columns)], src.path)
            assert row is not None, "a row without a problem"
            self._rows[i] = row
        return row


def lazy_rows(path: Any, kind: str, columns: Mapping[str, str] | None = None) -> CollectionSequence[Row]:
    """Rows of `path` (a data file, or a data/mixture.py MixtureSpec) read on use."""
    spec = getattr(path, "mixed_rows", None)
    if spec is not None:
        return spec(kind, columns)
    return LazyRows(open_source(path, kind, columns), kind)
