"""lathe.data.files: locating data files, and what a file holds read without reading its rows (`peek`)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lathe.data.errors import DataError
from lathe.data.files import column_values, data_files, locate, peek

ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
       "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}


def test_a_parquet_file_gives_its_schema_and_one_column_is_read_alone(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([ROW, {**ROW, "data_source": "lighteval/MATH"}, ROW]), path)
    cols = peek(str(path), key="data.train_files")
    assert cols.src == str(path) and cols.have == "the file's columns" and cols.first is None
    assert cols.names == {"data_source": None, "prompt": None, "ability": None,
                          "reward_model": ("style", "ground_truth"), "extra_info": ("index",)}
    assert column_values(cols, "data_source") == {"openai/gsm8k", "lighteval/MATH"}
    assert column_values(cols, "no_such_column") == set()


def test_a_jsonl_file_is_read_to_its_first_row_only(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n" + json.dumps(ROW) + "\n{not json at all\n")     # a bad later line is the loader's to find
    cols = peek(str(path))
    assert cols.first == ROW and cols.have == "the first row's keys"
    assert cols.names["reward_model"] == ("style", "ground_truth") and cols.names["prompt"] is None
    assert column_values(cols, "data_source") == {"openai/gsm8k"}


def test_a_json_array_is_left_to_the_loader_and_a_builtin_gives_its_first_row(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROW]))
    assert peek(str(path)) is None
    assert "prompt" in peek("builtin:arithmetic", "val").names


@pytest.mark.parametrize("name, body, match", [
    ("gone.parquet", None, r"data.val_files: data file not found: .*gone\.parquet. Fix: check the path"),
    ("x.csv", "a,b\n", r"data.val_files: .*x\.csv: unsupported file type '\.csv'"),
    ("bad.parquet", "not parquet", r"bad\.parquet: cannot read as parquet .*Fix:"),
    ("empty.jsonl", "\n", r"data.val_files: .*empty\.jsonl: no rows. Fix: point data.val_files at a non-empty file"),
])
def test_a_file_that_cannot_be_read_names_the_key(tmp_path, name, body, match):
    if body is not None:
        (tmp_path / name).write_text(body)
    with pytest.raises(DataError, match=match):
        peek(str(tmp_path / name), key="data.val_files")


def test_locate_and_data_files():
    assert locate("builtin:arithmetic") == "builtin:arithmetic"
    with pytest.raises(DataError, match=r"data.train_files: unknown builtin data set 'builtin:nope'"):
        locate("builtin:nope", "data.train_files")
    assert data_files("a.parquet") == ["a.parquet"] and data_files(["a", "b"]) == ["a", "b"]
    with pytest.raises(DataError, match="no data files given"):
        data_files([])
