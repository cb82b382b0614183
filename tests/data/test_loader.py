"""Tests for lathe.data.loader.StatefulDataLoader: batching, seeded order per epoch, exact resume."""

import itertools

import pytest

from lathe.data.errors import DataError
from lathe.data.loader import StatefulDataLoader


def items(n):
    return [{"i": i} for i in range(n)]


def ids(batches):
    return [[x["i"] for x in b] for b in batches]


def take(loader, k):
    """The next k batches, crossing epoch boundaries as a training loop does."""
    out = []
    while len(out) < k:
        out.extend(itertools.islice(iter(loader), k - len(out)))
    return ids(out)


def test_len_and_batches_drop_last():
    loader = StatefulDataLoader(items(10), 4, shuffle=False, seed=0)
    assert len(loader) == 2
    assert ids(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_keep_last_partial_batch():
    loader = StatefulDataLoader(items(10), 4, shuffle=False, seed=0, drop_last=False)
    assert len(loader) == 3
    assert ids(loader)[-1] == [8, 9]


def test_shuffled_epoch_is_a_permutation():
    loader = StatefulDataLoader(items(37), 5, shuffle=True, seed=1, drop_last=False)
    flat = [i for b in ids(loader) for i in b]
    assert sorted(flat) == list(range(37)) and flat != list(range(37))


def test_same_seed_same_order_other_seed_differs():
    a = take(StatefulDataLoader(items(40), 8, shuffle=True, seed=5), 12)
    b = take(StatefulDataLoader(items(40), 8, shuffle=True, seed=5), 12)
    c = take(StatefulDataLoader(items(40), 8, shuffle=True, seed=6), 12)
    assert a == b and a != c


def test_epochs_reshuffle_and_advance():
    loader = StatefulDataLoader(items(40), 8, shuffle=True, seed=0)
    first = ids(loader)
    assert loader.epoch == 1 and loader.batch_in_epoch == 0
    second = ids(loader)
    assert loader.epoch == 2
    assert len(first) == len(second) == 5
    assert first != second
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(40))


def test_epoch_order_is_a_function_of_seed_and_epoch():
    walked = StatefulDataLoader(items(30), 10, shuffle=True, seed=9)
    for _ in range(3):
        list(walked)
    fresh = StatefulDataLoader(items(30), 10, shuffle=True, seed=9)
    assert list(fresh.epoch_order(3)) == list(walked.epoch_order(3))
    assert ids(walked) == [list(fresh.epoch_order(3)[k:k + 10]) for k in (0, 10, 20)]


@pytest.mark.parametrize("consumed", [1, 3, 5, 7])
def test_mid_epoch_state_round_trip(consumed):
    # 5 batches per epoch: consumed=5 lands exactly on an epoch boundary, 7 in epoch 1
    original = StatefulDataLoader(items(43), 8, shuffle=True, seed=3)
    take(original, consumed)
    state = original.state_dict()
    assert state == {"epoch": consumed // 5, "batch_in_epoch": consumed % 5, "seed": 3}
    remaining = take(original, 9)

    resumed = StatefulDataLoader(items(43), 8, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 9) == remaining


def test_breaking_out_keeps_position():
    loader = StatefulDataLoader(items(40), 10, shuffle=False, seed=0)
    for batch in loader:
        break
    assert loader.state_dict()["batch_in_epoch"] == 1
    assert ids(loader) == [list(range(10, 20)), list(range(20, 30)), list(range(30, 40))]


def test_dataset_smaller_than_batch_is_an_error():
    with pytest.raises(DataError, match=r"batch of 16 prompts \(data\.train_batch_size.*\(5 prompts after filtering\)"):
        StatefulDataLoader(items(5), 16, shuffle=True, seed=0)
    with pytest.raises(DataError, match="0 prompts"):
        StatefulDataLoader([], 1, shuffle=True, seed=0, drop_last=False)


def test_load_state_rejects_position_outside_epoch():
    loader = StatefulDataLoader(items(20), 5, shuffle=True, seed=0)
    with pytest.raises(DataError, match="batch_in_epoch=4.*4 batches per epoch"):
        loader.load_state_dict({"epoch": 0, "batch_in_epoch": 4, "seed": 0})
    with pytest.raises(DataError, match="missing"):
        loader.load_state_dict({"epoch": 0})


def test_saved_seed_wins_with_warning():
    saved = StatefulDataLoader(items(20), 5, shuffle=True, seed=1)
    take(saved, 2)
    state = saved.state_dict()
    rest = take(saved, 3)
    other = StatefulDataLoader(items(20), 5, shuffle=True, seed=2)
    with pytest.warns(UserWarning, match="seed 1"):
        other.load_state_dict(state)
    assert take(other, 3) == rest
