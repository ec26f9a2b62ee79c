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


def _type_problem(name: str, key: str, typ) -> str | None:
    """Why column `name` (the project's `key`) cannot hold that key's values, or None. messages:
    a list of turns; chosen/rejected: a string or a list of turns; the other string keys: strings."""
    import pyarrow as pa
    text = pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)
    messages = pa.types.is_list(typ) or pa.types.is_large_list(typ)
    if messages if key == "messages" else text or (key in ("chosen", "rejected") and messages):
        return None
    allowed = "a list of {role, content} structs" if key == "messages" else "string"
    return f"column {name!r} (key {key!r}) has type {typ}; allowed: {allowed}"


def _check_types(schema, rename: dict[str, str], path: Path, kind: str) -> None:
    """Each key's column type, from the schema alone (nothing read)."""
    problems = [p for field in schema if (key := rename.get(field.name, field.name)) in (*STRING_KEYS, "messages")
                and (p := _type_problem(field.name, key, field.type)) is not None]
    if problems:
        raise ConfigError(problems, path)


def _check_schema(table, rename: dict[str, str], path: Path, kind: str) -> None:
    """Column types and nulls of the keys whose values must be strings, before any row is read."""
    import pyarrow.compute as pc
    problems = []
    for name in table.column_names:
        key = rename.get(name, name)
        if key not in (*STRING_KEYS, "messages"):
            continue
        col = table.column(name)
        if (problem := _type_problem(name, key, col.type)) is not None:
            problems.append(problem)
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


# --- random access by row index: each rank reads only the rows it uses ---------------------------

class RowSource:
    """A data file opened for random access by row index (0-based position among its rows):
    len() is known without reading the rows, record(i) reads row i alone (the column map
    applied, other columns kept). `reads` counts the records converted, `unit` is how errors
    name a row ("line" for JSONL, numbered from 1, "row" for tables, from 0)."""

    unit = "row"

    def __init__(self, path: Path, kind: str, columns: Mapping[str, str]):
        self.path, self.kind, self.columns = path, kind, dict(columns)
        self.reads = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def number(self, i: int) -> int:
        """How errors number position i (its line for JSONL, its row for tables)."""
        return i

    def record(self, i: int) -> Any:
        self.reads += 1
        return self._record(i)

    def _record(self, i: int) -> Any:
        raise NotImplementedError


NEWLINE = 10
INDEX_CHUNK = 1 << 26
"""Bytes of a JSONL file scanned at a time while its line index is built."""


class JsonlSource(RowSource):
    """JSONL with a byte-offset index of its non-blank lines, built in one pass over the bytes
    (no JSON parsed): 24 bytes a line, and a row costs one seek and one read."""

    unit = "line"

    def __init__(self, path: Path, kind: str, columns: Mapping[str, str]):
        import numpy as np
        super().__init__(path, kind, columns)
        ends: list[Any] = []
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                offset = 0
                while offset < size:
                    chunk = np.frombuffer(f.read(INDEX_CHUNK), dtype=np.uint8)
                    ends.append(np.flatnonzero(chunk == NEWLINE) + offset)
                    offset += len(chunk)
        except OSError as e:
            raise ConfigError([f"cannot read {kind} data file ({e})"], path) from None
        end = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
        if size and (not len(end) or end[-1] != size - 1):
            end = np.append(end, size)            # a last line without its newline
        start = np.concatenate([[0], end[:-1] + 1]).astype(np.int64) if len(end) else end
        # blank lines ("\n", "\r\n") are skipped, as the eager reader skips them
        blank = (end - start == 0) | ((end - start == 1) & self._byte_is(path, start, 13))
        keep = np.flatnonzero(~blank)
        self._start, self._end, self._line = start[keep], end[keep], keep + 1
        self._file: Any = None

    @staticmethod
    def _byte_is(path: Path, at, value: int):
        import numpy as np
        out = np.zeros(len(at), dtype=bool)
        if len(at):
            data = np.memmap(path, dtype=np.uint8, mode="r")
            ok = at < len(data)
            out[ok] = data[at[ok]] == value
        return out

    def __len__(self) -> int:
        return len(self._start)

    def number(self, i: int) -> int:
        return int(self._line[i])

    def _record(self, i: int) -> Any:
        if self._file is None:
            self._file = self.path.open("rb")
        self._file.seek(int(self._start[i]))
        raw = self._file.read(int(self._end[i] - self._start[i]))
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
            return _NotJson(f"not valid JSON ({msg})")
        if self.columns and isinstance(obj, dict):
            missing = [theirs for theirs in self.columns.values() if theirs not in obj]
            if missing:
                ours = [k for k, v in self.columns.items() if v in missing]
                raise ConfigError([f"line {self.number(i)}: no key(s) {missing}, which data.columns maps to "
                                   f"{ours} (found {sorted(obj)})"], self.path)
            obj = {**{k: v for k, v in obj.items() if k not in self.columns.values()},
                   **{ours: obj[theirs] for ours, theirs in self.columns.items()}}
        return obj


class TableSource(RowSource):
    """A pyarrow table read in pieces: `_piece(i)` gives (a table holding row i, its offset in
    it). The schema is checked when the source opens (the column map, each key's type)."""

    def _setup(self, schema, num_rows: int) -> None:
        self._rename = map_columns(list(schema.names), self.columns, self.path, self.kind)
        _check_types(schema, self._rename, self.path, self.kind)
        self._drop = [n for n in schema.names if n in self.columns and n not in self._rename]
        self._n = num_rows

    def __len__(self) -> int:
        return self._n

    def _piece(self, i: int):
        raise NotImplementedError

    def _record(self, i: int) -> Any:
        table, at = self._piece(i)
        row = table.slice(at, 1).to_pylist()[0]
        row = {self._rename.get(k, k): v for k, v in row.items() if k not in self._drop}
        nulls = [k for k in (*STRING_KEYS, "messages") if k in row and row[k] is None]
        if nulls:
            names = {ours: theirs for theirs, ours in self._rename.items()}
            raise ConfigError([f"row {i}: column {names.get(k, k)!r} (key {k!r}) is null" for k in nulls], self.path)
        return row


GROUPS_KEPT = 4
"""Parquet row groups a source keeps decoded (the most recently used)."""


class ParquetSource(TableSource):
    """Parquet read by row groups: row i reads only its row group (the GROUPS_KEPT last used
    are kept). A group is the unit of reading: write large files with row groups of a few
    thousand rows (pyarrow's default is 1Mi rows, the whole file of most prompt sets)."""

    def __init__(self, path: Path, kind: str, columns: Mapping[str, str]):
        import numpy as np
        import pyarrow.parquet as pq
        super().__init__(path, kind, columns)
        try:
            self._pf = pq.ParquetFile(path, memory_map=True)
        except Exception as e:   # pyarrow's errors for corrupt or non-parquet files
            raise ConfigError([f"cannot read {kind} data as parquet ({type(e).__name__}: {e}); expected {ALLOWED}"],
                              path) from None
        meta = self._pf.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._setup(self._pf.schema_arrow, int(self._first[-1]))
        self._groups: dict[int, Any] = {}   # insertion order = least recently used first
        self.groups_read = 0

    def _piece(self, i: int):
        import numpy as np
        g = int(np.searchsorted(self._first, i, side="right") - 1)
        table = self._groups.pop(g, None)
        if table is None:
            table = self._pf.read_row_group(g)
            self.groups_read += 1
            if len(self._groups) >= GROUPS_KEPT:
                del self._groups[next(iter(self._groups))]
        self._groups[g] = table
        return table, i - int(self._first[g])


class ArrowSource(TableSource):
    """An Arrow IPC file or stream, or a save_to_disk folder's arrow files, memory-mapped: the
    table's buffers are the file's pages, and row i touches only its own."""

    def __init__(self, path: Path, kind: str, columns: Mapping[str, str], fmt: str):
        super().__init__(path, kind, columns)
        self._table = _mapped_table(path, fmt, kind)
        self._setup(self._table.schema, self._table.num_rows)

    def _piece(self, i: int):
        return self._table, i


def _mapped_table(path: Path, fmt: str, kind: str):
    import pyarrow as pa
    try:
        if fmt == "arrow":
            source = pa.memory_map(str(path))
            try:
                return pa.ipc.open_file(source).read_all()   # zero-copy from the map
            except pa.ArrowInvalid:   # datasets' own .arrow files are IPC streams, not IPC files
                return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        import datasets
        ds = datasets.load_from_disk(str(path), keep_in_memory=False)
        if not isinstance(ds, datasets.Dataset):
            raise ConfigError([f"{kind} data: {type(ds).__name__} folder; name one split's folder"], path)
        if ds._indices is not None:   # a selection saved with its indices: datasets gives rows in that order
            ds = ds.flatten_indices(keep_in_memory=True)
        return ds.data.table          # datasets' memory-mapped table
    except ConfigError:
        raise
    except Exception as e:   # pyarrow's and datasets' errors for unreadable or corrupt files
        raise ConfigError([f"cannot read {kind} data as {fmt} ({type(e).__name__}: {e}); expected {ALLOWED}"],
                          path) from None


def open_source(path: str | Path, kind: str, columns: Mapping[str, str] | None = None) -> RowSource:
    """The data file at `path` for random access by row (any format of this module); its schema
    (tables) or its line index (JSONL) is read now, its rows when asked for."""
    path = Path(path)
    fmt = data_format(path, kind)
    columns = dict(columns or {})
    if fmt == "jsonl":
        return JsonlSource(path, kind, columns)
    if fmt == "parquet":
        return ParquetSource(path, kind, columns)
    return ArrowSource(path, kind, columns, fmt)


SAMPLE_BLOCKS = 20


def sample_positions(n: int, k: int, seed: int) -> list[int]:
    """At most k row positions of n to check on the login node: all of them when n <= k, else
    SAMPLE_BLOCKS seeded runs of consecutive rows (a parquet row group or a stretch of the JSONL
    file each, so the check reads a bounded part of a large file)."""
    import numpy as np
    if n <= k:
        return list(range(n))
    block = max(1, k // SAMPLE_BLOCKS)
    picked = np.random.default_rng(seed).choice(n // block, size=min(k // block, n // block), replace=False)
    return sorted(int(b) * block + j for b in picked for j in range(block))
