import math

import numpy as np
import pytest
import torch

from lathe.track.metrics import flatten_values, reduce_metrics, to_scalar


def test_reduce_list_of_dicts_means_mixed_types():
    rows = [
        {"actor/pg_loss": 0.1, "actor/entropy": torch.tensor(2.0)},
        {"actor/pg_loss": torch.tensor([0.2, 0.6]), "actor/entropy": [1.0, 3.0]},
    ]
    out = reduce_metrics(rows)
    assert out["actor/pg_loss"] == pytest.approx((0.1 + 0.2 + 0.6) / 3)
    assert out["actor/entropy"] == pytest.approx(2.0)
    assert all(type(v) is float for v in out.values())


def test_reduce_dict_of_lists_like_verl_with_max_min_keys():
    out = reduce_metrics(
        {
            "response_length/max": [3, 9, 4],
            "response_length/min": [3, 9, 4],
            "critic/score/mean": [0.0, 1.0],
            "actor/pg_clipfrac": [0.25, 0.75],
        }
    )
    assert out == {
        "response_length/max": 9.0,
        "response_length/min": 3.0,
        "critic/score/mean": 0.5,
        "actor/pg_clipfrac": 0.5,
    }


def test_reduce_empty_list_is_nan_and_bad_value_names_key():
    assert math.isnan(reduce_metrics({"x": []})["x"])
    with pytest.raises(TypeError, match="'actor/bad'"):
        reduce_metrics([{"actor/bad": "oops"}])
    with pytest.raises(TypeError, match="item 0"):
        reduce_metrics(["not a dict"])


def test_to_scalar_types():
    assert to_scalar("a", 3) == 3 and type(to_scalar("a", 3)) is int
    assert type(to_scalar("a", np.int64(5))) is int
    assert to_scalar("a", True) == 1
    assert to_scalar("a", torch.tensor(1.5, dtype=torch.bfloat16)) == 1.5
    assert to_scalar("a", torch.tensor([1.0, 2.0, 6.0])) == pytest.approx(3.0)
    assert to_scalar("a", np.float32(0.25)) == 0.25
    with pytest.raises(TypeError, match="'a'.*empty"):
        to_scalar("a", [])
    with pytest.raises(TypeError, match="'k'"):
        to_scalar("k", {"x": 1})


def test_flatten_nested():
    assert flatten_values([1, [2, torch.tensor([3.0, 4.0])], np.array([[5.0]])]) == [1.0, 2.0, 3.0, 4.0, 5.0]
