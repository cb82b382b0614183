"""Tests for lathe.batch.Batch: row selection, splitting, concatenation, repetition and field updates."""

import numpy as np
import pytest
import torch

from lathe.batch import Batch


def _batch(n: int = 6) -> Batch:
    """Rows whose values encode their index, so every reordering is visible."""
    return Batch(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32) / 10},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra": [{"i": i} for i in range(n)]},
        meta={"step": 7},
    )


def _rows(b: Batch) -> list[int]:
    """Original row index of each row (from the `ids` tensor), checked against the object column."""
    rows = (b["ids"][:, 0] // 3).tolist()
    assert list(b["uid"]) == [f"u{i}" for i in rows]
    assert [e["i"] for e in b["extra"]] == rows
    assert torch.equal(b["score"], torch.tensor(rows, dtype=torch.float32) / 10)
    return rows


def test_construction_converts_lists_to_object_arrays_and_reports_length():
    b = _batch(4)
    assert len(b) == 4
    assert isinstance(b.non_tensors["uid"], np.ndarray) and b.non_tensors["uid"].dtype == object
    assert "ids" in b and "uid" in b and "missing" not in b
    assert len(Batch()) == 0
    assert len(Batch(non_tensors={"x": ["a", "b"]})) == 2


def test_getitem_unknown_field_names_the_known_ones():
    with pytest.raises(KeyError, match="ids"):
        _batch()["nope"]


def test_mismatched_field_sizes_are_rejected():
    with pytest.raises(ValueError, match="batch size"):
        Batch(tensors={"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="batch size"):
        Batch(tensors={"a": torch.zeros(3)}, non_tensors={"u": ["x", "y"]})


@pytest.mark.parametrize("idx", [[4, 0, 2], np.array([4, 0, 2]), torch.tensor([4, 0, 2])])
def test_select_by_indices_keeps_order(idx):
    assert _rows(_batch().select(idx)) == [4, 0, 2]


def test_select_negative_and_repeated_indices():
    assert _rows(_batch().select([-1, 1, 1])) == [5, 1, 1]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_select_by_boolean_mask(as_tensor):
    mask = [True, False, False, True, True, False]
    sel = _batch().select(torch.tensor(mask) if as_tensor else np.array(mask))
    assert _rows(sel) == [0, 3, 4]


def test_select_by_slice_and_meta_is_copied():
    b = _batch()
    sel = b.select(slice(1, 6, 2))
    assert _rows(sel) == [1, 3, 5]
    sel.meta["step"] = 99
    assert b.meta["step"] == 7


def test_select_empty():
    sel = _batch().select([])
    assert len(sel) == 0 and sel["ids"].shape == (0, 3)


def test_split_last_chunk_shorter():
    parts = _batch(7).split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert [_rows(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]


def test_chunk_equal_parts_and_uneven_rejected():
    parts = _batch(6).chunk(3)
    assert [_rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="6 into 4"):
        _batch(6).chunk(4)


def test_concat_round_trips_split_and_merges_meta():
    b = _batch(7)
    parts = b.split(3)
    parts[-1].meta["extra_key"] = 1
    back = Batch.concat(parts)
    assert _rows(back) == list(range(7))
    assert back.meta == {"step": 7, "extra_key": 1}


def test_concat_empty_list_rejected():
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_repeat_interleave_and_tile():
    b = _batch(3)
    assert _rows(b.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    assert _rows(b.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert _rows(b.repeat(3)) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_update_adds_fields_and_checks_size():
    b = _batch(4)
    out = b.update(Batch(tensors={"adv": torch.ones(4)}, non_tensors={"tag": list("abcd")}, meta={"m": 1}))
    assert out is b
    assert torch.equal(b["adv"], torch.ones(4)) and list(b["tag"]) == list("abcd") and b.meta["m"] == 1
    with pytest.raises(ValueError, match="3 rows into one of 4"):
        b.update(Batch(tensors={"adv": torch.ones(3)}))
    assert b["adv"].shape == (4,)


def test_update_with_meta_only_batch_is_allowed():
    b = _batch(4)
    b.update(Batch(meta={"k": "v"}))
    assert b.meta["k"] == "v" and len(b) == 4


def test_setitem_tensor_vs_list_moves_between_stores():
    b = _batch(3)
    b["x"] = torch.tensor([1, 2, 3])
    assert "x" in b.tensors and "x" not in b.non_tensors
    b["x"] = ["a", "b", "c"]
    assert "x" in b.non_tensors and "x" not in b.tensors
    assert b["x"].dtype == object and list(b["x"]) == ["a", "b", "c"]
    b["x"] = torch.zeros(3)
    assert "x" in b.tensors and "x" not in b.non_tensors
    arr = np.array([1.0, 2.0, 3.0])
    b["y"] = arr
    assert b.non_tensors["y"] is arr


def test_setitem_wrong_size_rejected_and_batch_unchanged():
    b = _batch(3)
    with pytest.raises(ValueError, match="batch size"):
        b["x"] = torch.zeros(4)
    with pytest.raises(ValueError, match="batch size"):
        b["uid"] = ["only", "two"]
    assert "x" not in b
    assert list(b["uid"]) == ["u0", "u1", "u2"]
    _rows(b)


def test_to_keeps_values():
    b = _batch(2).to("cpu")
    assert _rows(b) == [0, 1] and b.meta == {"step": 7}
