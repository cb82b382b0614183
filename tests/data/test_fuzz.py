"""Property-based: any row a data file can hold, and any bytes a JSON-lines file can hold, either load or raise
`DataError` naming the file — never another exception."""

from __future__ import annotations

import json
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lathe.data.builtin import builtin_tokenizer
from lathe.data.dataset import RLDataset
from lathe.data.errors import DataError

TOK = builtin_tokenizer()
FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=6))
JSONISH = st.recursive(LEAF, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.just("user"), JSONISH),
                                 "content": st.one_of(st.text(max_size=8), JSONISH)})
ROW = st.fixed_dictionaries(
    {},
    optional={"prompt": st.one_of(st.lists(MESSAGE, max_size=2), JSONISH),
              "data_source": st.one_of(st.just("lathe/arithmetic"), JSONISH),
              "reward_model": st.one_of(st.fixed_dictionaries({"ground_truth": st.one_of(st.just("3"), JSONISH)}),
                                        JSONISH),
              "extra_info": JSONISH, "ability": JSONISH})


def _load(path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        RLDataset(str(path), TOK, max_prompt_length=64)


@FUZZ
@given(st.lists(ROW, min_size=1, max_size=3))
def test_any_jsonl_rows_load_or_are_refused_naming_the_file(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        _load(path)
    except DataError as e:
        assert str(path) in str(e)


@FUZZ
@given(st.binary(max_size=64))
def test_any_bytes_in_a_jsonl_file_load_or_are_refused(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "data.jsonl"
    path.write_bytes(data)
    try:
        _load(path)
    except DataError as e:
        assert str(path) in str(e)


@FUZZ
@given(st.lists(ROW, min_size=1, max_size=3))
def test_any_parquet_rows_load_or_are_refused_naming_the_file(tmp_path_factory, rows):
    path = tmp_path_factory.mktemp("parquet") / "data.parquet"
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        return                                          # pyarrow cannot write such mixed columns at all
    try:
        _load(path)
    except DataError as e:
        assert str(path) in str(e)
