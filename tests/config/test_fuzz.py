"""Property-based: whatever values a user sets, `load_config` either accepts them or raises `ConfigError` naming
the key — never another exception, never a traceback from deep inside."""

from __future__ import annotations

import warnings

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from config.key_reads import schema_paths
from lathe.config import ConfigError, load_config

LEAVES = sorted(schema_paths()[0])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 64), st.integers(-10**9, 10**9),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                   st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=4)), max_size=3),
                   st.dictionaries(st.text(min_size=1, max_size=4), st.integers(-3, 3), max_size=2))
RAW = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=16)   # unparsed text after '='
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load(overrides: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config("base", overrides)


def _override(key: str, value) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix('...').strip()}"


@FUZZ
@given(st.sampled_from(LEAVES), VALUES)
def test_any_value_of_any_key_loads_or_is_refused_naming_the_key(key, value):
    try:
        _load([_override(key, value)])
    except ConfigError as e:
        assert key in str(e) or key.rsplit(".", 1)[-1] in str(e), (key, value, str(e))


@FUZZ
@given(st.sampled_from(LEAVES), RAW)
@example("critic.model.fsdp_config.tensor_parallel_size", "\x1f0")    # a separator str.isspace() calls space
def test_any_text_after_the_equals_sign_loads_or_is_refused(key, text):
    try:
        _load([f"{key}={text}"])
    except ConfigError as e:
        assert str(e)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(LEAVES), VALUES), min_size=2, max_size=4))
def test_combinations_load_or_are_refused(pairs):
    try:
        _load([_override(k, v) for k, v in pairs])
    except ConfigError as e:
        assert str(e)
