"""Reading data files (parquet, jsonl, json, `builtin:` names): every row, or only what a file holds.

`read_data_file` reads all rows, for the datasets; `peek` reads a parquet file's schema, or a JSON-lines file's first
row, so that `lathe train` / `lathe sft` can check the columns before anything loads (`lathe.loop.preflight`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from lathe.data.builtin import BUILTIN_DATASETS
from lathe.data.errors import DataError

PREPROCESS_HINT = (
    "create it with `lathe preprocess gsm8k <raw gsm8k dir or .jsonl> <output dir>` "
    "(see lathe.data.preprocess.PREPROCESSORS), or use files=builtin:arithmetic"
)


def _read_jsonl(path: str, limit: int | None = None) -> list[tuple[str, Any]]:
    """Rows of a JSON-lines file as (location, row), the first `limit` only when given; blank lines are skipped."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if limit is not None and len(rows) >= limit:
                break
            line = _utf8(raw, path, f"line {lineno}")
            if not line.strip():
                continue
            try:
                rows.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {lineno}: not valid JSON ({e.msg}). "
                    "Fix: one JSON object per line (JSON lines)."
                ) from None
    return rows


def _utf8(raw: bytes, path: str, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} {where}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}). Fix: "
                        "re-encode the file as UTF-8.") from None


def _read_json(path: str) -> list[tuple[str, Any]]:
    """A `.json` file: a top-level JSON array of rows, or JSON lines."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        return _read_jsonl(path)
    with open(path, "rb") as f:
        text = _utf8(f.read(), path, "(whole file)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}).") from None
    return [(f"row {i}", row) for i, row in enumerate(data)]


def _read_parquet(path: str) -> list[tuple[str, Any]]:
    """Rows of a parquet file as Python dicts (nested lists/structs become lists/dicts)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise not_parquet(path, e) from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def not_parquet(path: str, err: Exception) -> DataError:
    return DataError(f"{path}: cannot read as parquet ({err}). Fix: write it again (e.g. pandas.DataFrame.to_parquet), "
                     "or point the data key at a parquet or jsonl file.")


_READERS = {".parquet": _read_parquet, ".jsonl": _read_jsonl, ".json": _read_json}


def read_data_file(path: str, split: str = "train") -> list[tuple[str, Any]]:
    """Rows of one data source as (location, row): a builtin name, a parquet or jsonl file."""
    full = locate(path)
    if full in BUILTIN_DATASETS:
        return [(f"row {i}", row) for i, row in enumerate(BUILTIN_DATASETS[full](split))]
    return _READERS[os.path.splitext(full)[1].lower()](full)


def locate(path: str, key: str | None = None) -> str:
    """A builtin data set's name, or the readable file `path` names (`~` expanded); a DataError naming `key` (the
    config key that gave it) when it is neither."""
    named = f"{key}: " if key else ""
    if path in BUILTIN_DATASETS:
        return path
    if path.startswith("builtin:"):
        raise DataError(f"{named}unknown builtin data set {path!r}; available: {sorted(BUILTIN_DATASETS)}")
    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        raise DataError(f"{named}data file not found: {full}. Fix: check the path, or {PREPROCESS_HINT}.")
    ext = os.path.splitext(full)[1].lower()
    if ext not in _READERS:
        raise DataError(
            f"{named}{full}: unsupported file type {ext!r}; lathe reads {sorted(_READERS)} files "
            "in verl's schema. Fix: convert it, e.g. with pandas.DataFrame.to_parquet."
        )
    return full


def data_files(files: str | list[str] | None) -> list[str]:
    """`data.train_files` / `data.val_files` as a list: one path, or several; an empty list is an error."""
    listed = [files] if isinstance(files, str) else list(files or [])
    if not listed:
        raise DataError("no data files given. Fix: set data.train_files / data.val_files")
    return listed


@dataclass(frozen=True)
class Columns:
    """What a data file holds, read without reading its rows."""

    src: str                                    # the file (`~` expanded), or the builtin data set's name
    names: dict[str, tuple[str, ...] | None]    # column -> the fields of its struct (None: not a struct)
    have: str                                   # where `names` come from, for messages: "the file's columns", ...
    first: dict | None = None                   # the first row, when it was read (jsonl, builtin)


def peek(path: str, split: str = "train", key: str | None = None) -> Columns | None:
    """The columns of one data source (`locate`'s errors name `key`): a parquet file's schema, a JSON-lines file's
    first row, a builtin's first row. None for a JSON array (`.json` starting with `[`), whose rows are checked
    when read."""
    full = locate(path, key)
    if full in BUILTIN_DATASETS:
        rows = BUILTIN_DATASETS[full](split)[:1]
    elif full.lower().endswith(".parquet"):
        return Columns(full, _parquet_columns(full), "the file's columns")
    else:
        with open(full, "rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return None
        rows = [row for _, row in _read_jsonl(full, limit=1)]
    if not rows:
        raise DataError(f"{key + ': ' if key else ''}{full}: no rows. Fix: point {key or 'the data key'} at a "
                        "non-empty file.")
    if not isinstance(rows[0], dict):
        raise DataError(f"{full} first row: expected a JSON object, got {type(rows[0]).__name__}")
    names = {k: tuple(v) if isinstance(v, dict) else None for k, v in rows[0].items()}
    return Columns(full, names, "the first row's keys", rows[0])


def _parquet_columns(path: str) -> dict[str, tuple[str, ...] | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise not_parquet(path, e) from None
    return {f.name: tuple(sub.name for sub in f.type) if pa.types.is_struct(f.type) else None for f in schema}


def column_values(cols: Columns, column: str) -> set:
    """The distinct string values of a (small, e.g. `data_source`) column: the column read alone from a parquet
    file, else the first row's."""
    if column not in cols.names:
        return set()
    if cols.first is not None:
        values = [cols.first[column]]
    else:
        import pyarrow.parquet as pq
        try:
            values = pq.read_table(cols.src, columns=[column]).column(0).unique().to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise not_parquet(cols.src, e) from None
    return {v for v in values if isinstance(v, str)}
