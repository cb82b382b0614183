import numpy as np
import pytest
import torch

from lathe.algo.dapo import filter_groups, overlong_reward_penalty


def test_filter_groups_drops_zero_variance_keeps_singletons():
    index = ["a", "a", "a", "b", "b", "c", "d", "d"]
    acc = [1, 1, 1, 0, 1, 1, 0.5, 0.5]
    keep = filter_groups(np.array(index, dtype=object), acc)
    expected = []
    for key in index:
        group = [v for k, v in zip(index, acc, strict=True) if k == key]
        expected.append(len(group) == 1 or max(group) != min(group))
    assert keep.tolist() == expected == [False, False, False, True, True, True, False, False]


def test_filter_groups_accepts_tensors():
    keep = filter_groups([1, 1, 2, 2], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert keep.tolist() == [False, False, True, True]


def _paper(length, l_max, l_cache):
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty_follows_dapo_eq13(factor):
    lengths = [0, 100, 767, 768, 800, 1000, 1024, 1500]
    out = overlong_reward_penalty(torch.tensor(lengths), 1024, 256, penalty_factor=factor)
    expected = [factor * _paper(n, 1024, 256) for n in lengths]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_overlong_buffer_must_fit():
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_reward_penalty([10], 100, 0)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_reward_penalty([10], 100, 101)
