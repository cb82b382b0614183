"""Tests for lathe.cli.generate_options: `lathe generate`'s keys, parsed like config overrides, the sampling keys
taken from `SamplingParams`' own fields."""

import dataclasses

import pytest

from lathe.cli.generate_options import GenerateError, GenerateOptions, parse_options
from lathe.generation import SamplingParams


def test_options_parse_like_overrides_and_unknown_keys_get_a_suggestion():
    o = parse_options(["temperature=0", "n=2", "stop=###", "stop_token_ids=7", "seed=null", "dtype=float32"])
    s = o.sampling
    assert (s.temperature, s.n, s.stop, s.stop_token_ids, s.seed, o.dtype) == (0.0, 2, ["###"], [7], None, "float32")
    assert parse_options(['stop=["\\n\\n", "Q:"]']).sampling.stop == ["\n\n", "Q:"]
    with pytest.raises(GenerateError, match="(?i)did you mean `temperature`"):
        parse_options(["temprature=0"])
    with pytest.raises(ValueError, match="top_p=2"):
        parse_options(["top_p=2"])
    with pytest.raises(ValueError, match="bfloat16"):
        parse_options(["dtype=bf16"])
    with pytest.raises(ValueError, match="n=two"):
        parse_options(["n=two"])
    with pytest.raises(GenerateError, match="min_tokens=9"):
        parse_options(["max_tokens=8", "min_tokens=9"])


def test_every_sampling_field_is_a_key_parsed_by_its_type():
    """A SamplingParams field needs no second declaration: each is a key, typed and checked by its annotation."""
    for f in dataclasses.fields(SamplingParams):
        with pytest.raises(ValueError, match=f.name):
            parse_options([f"{f.name}=[{{bad: 1}}]"])                  # fits no sampling field
    o = parse_options(["do_sample=false", "top_k=5"])
    assert o.sampling == SamplingParams(do_sample=False, top_k=5, max_tokens=512)
    assert GenerateOptions().sampling.max_tokens == 512                # lathe generate's own default
    with pytest.raises(GenerateError, match="Known keys: n, temperature"):
        parse_options(["sampling=1"])                                   # the group itself is not a key
