"""Tests for lathe.config.coerce: the strict YAML dialect and annotation-driven coercion."""

from typing import Any, Literal

import pytest

from lathe.config import ConfigError
from lathe.config.coerce import coerce, dump_yaml, load_yaml, parse_value, type_name


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1e-6", 1e-6), ("3", 3), ("-2", -2), ("0.", 0.0), ("null", None), ("~", None), ("true", True),
     ("False", False), ("[a,b]", ["a", "b"]), ("['console','wandb']", ["console", "wandb"]),
     ("{x: 1}", {"x": 1}), ("yes", "yes"), ("on", "on"), ("2024-01-01", "2024-01-01"), ("1.2.3", "1.2.3")],
)
def test_parse_value_uses_yaml12_scalars(text, expected):
    assert parse_value(text) == expected
    assert type(parse_value(text)) is type(expected)


def test_parse_value_keeps_unparseable_text():
    assert parse_value("[a, b") == "[a, b"
    assert parse_value("") == ""


def test_dump_quotes_strings_that_would_read_back_as_other_types():
    data = {"a": "1e-6", "b": "yes", "c": "null", "d": "true", "e": 1e-6, "f": "plain"}
    assert load_yaml(dump_yaml(data)) == data


@pytest.mark.parametrize(
    ("value", "tp", "expected"),
    [(1, float, 1.0), ("1e-6", float, 1e-6), ("8", int, 8), ("true", bool, True), (None, int | None, None),
     ("grpo", str, "grpo"), (12, str, "12"), ("a", str | list[str], "a"), (["a", "b"], str | list[str], ["a", "b"]),
     (None, dict, {}), ({"k": 1}, dict[str, Any], {"k": 1}), ("left", Literal["error", "left"], "left")],
)
def test_coerce_accepts_and_converts(value, tp, expected):
    out = coerce(value, tp, "k")
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    ("value", "tp"),
    [("abc", int), (2.5, int), (True, int), ("yes", bool), (1, bool), ("x", float), (None, int), ([1], str),
     ("lft", Literal["error", "left"]), ("a", list[int]), ({"a": 1}, list[str]), (3, dict)],
)
def test_coerce_rejects_with_key_in_message(value, tp):
    with pytest.raises(ConfigError) as err:
        coerce(value, tp, "group.the_key", example=7)
    assert "group.the_key" in str(err.value)


def test_str_field_keeps_raw_override_text():
    assert coerce(0.1, str, "trainer.experiment_name", raw="0.10") == "0.10"
    assert coerce("x", str, "k", raw="'quoted'") == "quoted"


def test_scalar_to_list_only_where_allowed():
    assert coerce("console", list[str], "trainer.logger", meta={"scalar_to_list": True}) == ["console"]
    with pytest.raises(ConfigError):
        coerce("console", list[str], "trainer.logger")


def test_literal_typo_suggests_choice():
    with pytest.raises(ConfigError, match="Did you mean `middle`"):
        coerce("midle", Literal["error", "left", "right", "middle"], "data.truncation")


def test_whole_interpolation_is_deferred_for_any_type():
    assert coerce("${data.train_batch_size}", int, "critic.x") == "${data.train_batch_size}"
    with pytest.raises(ConfigError):
        coerce("a${data.train_batch_size}", int, "critic.x")


def test_type_name_is_readable():
    assert type_name(int | None) == "int or null"
    assert type_name(list[str]) == "list of str"
    assert "left" in type_name(Literal["error", "left"])
