"""Data files as users keep them: JSONL, parquet, Arrow/feather, or a Hugging Face
`datasets.save_to_disk` folder, with a column map from the project's keys to the file's columns.

    records(path, "prompt", columns={"prompt": "question", "answer": "gold"})
        -> ("row", [(0, {"prompt": ..., "answer": ..., <other columns>}), ...])

Each record is a plain dict as a JSONL line would give it, so the row checks of data/jsonl.py
(and their errors) apply to every format alike. Tables are read with pyarrow (parquet, Arrow IPC
files and streams) or `datasets.load_from_disk` (nothing is downloaded: a hub id is refused with
the way to make the data local); their schema is checked before any row is converted (a mapped
column missing, a key's column of the wrong type, nulls), so a bad file fails on the login node
with the file, the column and what is allowed. Rows of tables are numbered from 0 ("row 0"),
JSONL lines from 1 ("line 1"), as each is usually looked at.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slurm_align.config.errors import ConfigError

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow",
           ".ipc": "arrow"}
"""File suffix -> format; a folder is a `datasets.save_to_disk` folder."""
ALLOWED = "a .jsonl, .parquet or .arrow/.feather file, or a folder written by datasets' save_to_disk"
STRING_KEYS = ("prompt", "input", "chosen", "rejected")
"""Keys whose column must hold strings (SFT 'output' and preference replies may also be messages)."""


class _NotJson(str):
    """What a JSONL line that is not JSON gives instead of a value: the parser's complaint."""


def data_format(path: Path, kind: str) -> str:
    """'jsonl', 'parquet', 'arrow' or 'hf_disk' (a save_to_disk folder), from the path."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise ConfigError([f"{kind} data: a DatasetDict folder (several splits); name one split's folder "
                               f"instead, one of {[str(path / s) for s in splits]}"], path)
        if not (path / "state.json").is_file():
            raise ConfigError([f"{kind} data: a folder without datasets' state.json; expected {ALLOWED}"], path)
        return "hf_disk"
    if not path.exists():
        hint = ("; a Hugging Face hub id is not downloaded: load it where the network is and save it with "
                "datasets' Dataset.save_to_disk(FOLDER), then name FOLDER") if not path.suffix else ""
        raise ConfigError([f"{kind} data file not found{hint}"], path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError([f"{kind} data: unknown file type {path.suffix!r}; expected {ALLOWED}"], path)
    return fmt


def _json_lines(path: Path, kind: str) -> list[tuple[int, Any]]:
    """(line number, parsed value, or _NotJson) for every non-blank line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"cannot read {kind} data file ({e})"], path) from None
    out: list[tuple[int, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            out.append((n, _NotJson(f"not valid JSON ({e.msg} at column {e.colno})")))
    return out


def read_table(path: Path, fmt: str, kind: str):
    """The file as one pyarrow Table (parquet, Arrow IPC file or stream, save_to_disk folder)."""
    import pyarrow as pa  # deferred: only table formats need pyarrow (and datasets) loaded
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path)
        if fmt == "arrow":
            try:
                with pa.memory_map(str(path)) as source:
                    return pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:   # datasets' own .arrow files are IPC streams, not IPC files
                with pa.memory_map(str(path)) as source:
                    return pa.ipc.open_stream(source).read_all()
        import datasets
        ds = datasets.load_from_disk(str(path))
        if not isinstance(ds, datasets.Dataset):
            raise ConfigError([f"{kind} data: {type(ds).__name__} folder; name one split's folder"], path)
        return ds.with_format("arrow")[:]
    except ConfigError:
        raise
    except Exception as e:   # pyarrow's and datasets' errors for unreadable or corrupt files
        raise ConfigError([f"cannot read {kind} data as {fmt} ({type(e).__name__}: {e}); expected {ALLOWED}"],
                          path) from None


def map_columns(names: list[str], columns: Mapping[str, str], path: Path, kind: str) -> dict[str, str]:
    """{file column: our key} for the mapped columns; every mapped column must exist."""
    missing = {ours: theirs for ours, theirs in columns.items() if theirs not in names}
    if missing:
        raise ConfigError([f"data.columns maps {ours!r} to column {theirs!r}, which the {kind} data does not have "
                           f"(its columns: {names})" for ours, theirs in missing.items()], path)
    return {theirs: ours for ours, theirs in columns.items()}


def _check_schema(table, rename: dict[str, str], path: Path, kind: str) -> None:
    """Column types and nulls of the keys whose values must be strings, before any row is read."""
    import pyarrow as pa
    import pyarrow.compute as pc
    problems = []
    for name in table.column_names:
        key = rename.get(name, name)
        if key not in STRING_KEYS and key != "messages":
            continue
        col = table.column(name)
        typ = col.type
        text = pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)
        messages = pa.types.is_list(typ) or pa.types.is_large_list(typ)
        # messages: a list of turns; chosen/rejected: a string or a list of turns; others: strings
        ok = messages if key == "messages" else text or (key in ("chosen", "rejected") and messages)
        if not ok:
            allowed = "a list of {role, content} structs" if key == "messages" else "string"
            problems.append(f"column {name!r} (key {key!r}) has type {typ}; allowed: {allowed}")
        elif col.null_count:
            first = pc.index(pc.is_null(col), True).as_py()
            problems.append(f"row {first}: column {name!r} (key {key!r}) is null ({col.null_count} null rows)")
    if problems:
        raise ConfigError(problems, path)


def records(path: str | Path, kind: str, columns: Mapping[str, str] | None = None
            ) -> tuple[str, list[tuple[int, Any]]]:
    """("line" or "row", [(number, record)]): every row of a data file as a dict with the
    project's keys (the column map applied), other columns kept. JSONL lines that are not JSON
    objects come as they are (the caller names what is wrong)."""
    path = Path(path)
    columns = dict(columns or {})
    fmt = data_format(path, kind)
    if fmt == "jsonl":
        lines = _json_lines(path, kind)
        if not columns:
            return "line", lines
        out: list[tuple[int, Any]] = []
        for n, obj in lines:
            if isinstance(obj, dict) and not isinstance(obj, _NotJson):
                missing = [theirs for theirs in columns.values() if theirs not in obj]
                if missing:
                    ours = [k for k, v in columns.items() if v in missing]
                    raise ConfigError([f"line {n}: no key(s) {missing}, which data.columns maps to {ours} "
                                       f"(found {sorted(obj)})"], path)
                obj = {**{k: v for k, v in obj.items() if k not in columns.values()},
                       **{ours: obj[theirs] for ours, theirs in columns.items()}}
            out.append((n, obj))
        return "line", out
    table = read_table(path, fmt, kind)
    rename = map_columns(table.column_names, columns, path, kind)
    _check_schema(table, rename, path, kind)
    # A column already named as a mapped key gives way to the column mapped onto that key.
    table = table.drop_columns([n for n in table.column_names if n in columns and n not in rename])
    table = table.rename_columns([rename.get(n, n) for n in table.column_names])
    return "row", list(enumerate(table.to_pylist()))
