import numpy as np
import pytest
import torch

from lathe.algo.utils import entropy_from_logits, group_ids, masked_mean, masked_sum, masked_var, masked_whiten


def _valid(values, mask):
    return values.numpy()[mask.numpy() > 0]


def test_masked_stats_match_numpy_over_valid_entries(randn, ragged_mask):
    values, mask = randn(5, 6), ragged_mask(5, 6)
    v = _valid(values, mask)
    assert float(masked_sum(values, mask)) == pytest.approx(v.sum(), rel=1e-12)
    assert float(masked_mean(values, mask)) == pytest.approx(v.mean(), rel=1e-12)
    assert float(masked_var(values, mask)) == pytest.approx(v.var(ddof=1), rel=1e-12)
    assert float(masked_var(values, mask, unbiased=False)) == pytest.approx(v.var(), rel=1e-12)


def test_masked_mean_along_dim_matches_row_loops(randn, ragged_mask):
    values, mask = randn(4, 5), ragged_mask(4, 5)
    rows = masked_mean(values, mask, dim=-1)
    for i in range(4):
        valid = values[i].numpy()[mask[i].numpy() > 0]
        assert float(rows[i]) == pytest.approx(valid.mean(), rel=1e-12)


def test_masked_mean_of_empty_mask_is_zero_not_nan(randn):
    values = randn(2, 3)
    assert float(masked_mean(values, torch.zeros(2, 3))) == 0.0


def test_masked_whiten_standardises_valid_entries(randn, ragged_mask):
    values, mask = randn(6, 5, scale=3.0) + 2.0, ragged_mask(6, 5)
    v = _valid(values, mask)
    expected = (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(_valid(masked_whiten(values, mask), mask), expected, rtol=1e-10)
    kept = _valid(masked_whiten(values, mask, shift_mean=False), mask)
    np.testing.assert_allclose(kept, expected + v.mean(), rtol=1e-10)


def test_nan_in_padding_does_not_leak(randn, ragged_mask):
    values, mask = randn(4, 5), ragged_mask(4, 5, min_len=2)
    mask[1, -1] = 0.0
    poisoned = values.clone()
    poisoned[mask == 0] = float("nan")
    assert torch.isfinite(masked_mean(poisoned, mask))
    assert float(masked_var(poisoned, mask)) == pytest.approx(float(masked_var(values, mask)), rel=1e-12)


def test_group_ids_dense_numbering_and_counts():
    gid, counts = group_ids(np.array(["b", "a", "b", "c", "a", "b"], dtype=object), 6)
    assert gid.tolist() == [0, 1, 0, 2, 1, 0]
    assert counts.tolist() == [3, 2, 1]
    gid2, _ = group_ids([7, 7, 3], 3)
    assert gid2.tolist() == [0, 0, 1]


def test_group_ids_rejects_wrong_length():
    with pytest.raises(ValueError, match="one group id per row"):
        group_ids(["a", "b"], 3)


def test_entropy_from_logits_matches_definition(randn):
    logits = randn(2, 3, 7)
    p = torch.softmax(logits, -1).numpy()
    expected = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(entropy_from_logits(logits).numpy(), expected, rtol=1e-10)
