"""Shared helpers for the preprocess scripts: find raw split files, read JSON lines, write parquet."""

from __future__ import annotations

import json
import os
from typing import Any


class PreprocessError(ValueError):
    """Raw input that cannot be converted; the message names the file, line and fix."""


def split_inputs(input_path: str, splits: tuple[str, ...]) -> dict[str, str]:
    """Map split name -> raw .jsonl file.

    `input_path` is a directory holding `<split>.jsonl` files (those present are used), or one
    .jsonl file whose split is read from its name ("test" in the name -> test, else the first
    of `splits`).
    """
    path = os.path.expanduser(input_path)
    if os.path.isdir(path):
        found = {s: os.path.join(path, f"{s}.jsonl") for s in splits}
        found = {s: p for s, p in found.items() if os.path.isfile(p)}
        if not found:
            raise PreprocessError(
                f"{path}: no {', '.join(s + '.jsonl' for s in splits)} inside. "
                "Fix: point to the folder holding the raw JSON-lines files, or to one .jsonl file."
            )
        return found
    if os.path.isfile(path):
        name = os.path.basename(path).lower()
        split = "test" if "test" in name and "test" in splits else splits[0]
        return {split: path}
    raise PreprocessError(f"input not found: {path}. Fix: give a folder with {splits} .jsonl files or one .jsonl file.")


def read_jsonl(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; bad JSON names the file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreprocessError(f"{path} line {lineno}: not valid JSON ({e.msg}).") from None
            if not isinstance(obj, dict):
                raise PreprocessError(f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}.")
            rows.append((lineno, obj))
    return rows


def require_str(obj: dict, key: str, path: str, lineno: int) -> str:
    """obj[key] as a non-empty string, or an error naming file, line and field."""
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise PreprocessError(
            f"{path} line {lineno}: field '{key}' must be a non-empty string, got {value!r}"[:300]
            + ". Fix: correct or remove this line."
        )
    return value


def write_parquet(rows: list[dict[str, Any]], path: str) -> str:
    """Write rows (verl schema dicts) to a parquet file, creating its folder; return the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def with_answer_tool(row: dict[str, Any], tool: str, system_prompt: str, ground_truth: str) -> dict[str, Any]:
    """`row` for verl's multi-turn tool recipes: `system_prompt` first, and extra_info.need_tools_kwargs /
    tools_kwargs = {tool: {"create_kwargs": {"ground_truth": ...}}}, with which the agent loop creates each
    trajectory's tool instance (so the tool scores submissions against this row's answer)."""
    row["prompt"] = [{"role": "system", "content": system_prompt}, *row["prompt"]]
    row["extra_info"]["need_tools_kwargs"] = True
    row["extra_info"]["tools_kwargs"] = {tool: {"create_kwargs": {"ground_truth": ground_truth}}}
    return row
