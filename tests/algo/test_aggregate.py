import numpy as np
import pytest
import torch

from lathe.algo.aggregate import LOSS_AGG_MODES, agg_loss, global_batch_info

SCALE = 16.0


def _ref(loss: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """Loops over sequences, straight from the mode definitions."""
    rows = [(loss[i][mask[i] > 0]) for i in range(len(loss))]
    rows = [r for r in rows if len(r) > 0]
    if mode == "token-mean":
        return float(np.concatenate(rows).mean())
    if mode == "token-sum":
        return float(np.concatenate(rows).sum())
    if mode == "seq-mean-token-sum":
        return float(np.mean([r.sum() for r in rows]))
    if mode == "seq-mean-token-mean":
        return float(np.mean([r.mean() for r in rows]))
    return float(np.mean([r.sum() for r in rows]) / SCALE)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_reference_with_an_empty_row(randn, ragged_mask, mode):
    loss, mask = randn(6, 8), ragged_mask(6, 8)
    mask[3] = 0.0  # a fully masked row does not count as a sequence
    out = agg_loss(loss, mask, mode, loss_scale_factor=SCALE)
    assert float(out) == pytest.approx(_ref(loss.numpy(), mask.numpy(), mode), rel=1e-12)


def _split(mask: torch.Tensor, sizes):
    start = 0
    for n in sizes:
        part = slice(start, start + n)
        width = max(int(mask[part].sum(1).max()), 1)  # each micro-batch trimmed to its own padded width
        yield part, width
        start += n


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_split_gives_the_whole_batch_gradient(randn, ragged_mask, mode):
    base, mask = randn(10, 9), ragged_mask(10, 9)
    mask[4] = 0.0
    whole = base.clone().requires_grad_(True)
    agg_loss(whole, mask, mode, loss_scale_factor=SCALE).backward()

    split = base.clone().requires_grad_(True)
    info = global_batch_info(mask, loss_scale_factor=SCALE)
    total = 0.0
    for part, width in _split(mask, [3, 1, 4, 2]):
        micro = agg_loss(split[part, :width], mask[part, :width], mode, **info)
        micro.backward()
        total += float(micro.detach())
    np.testing.assert_allclose(split.grad.numpy(), whole.grad.numpy(), rtol=1e-12, atol=1e-15)
    assert total == pytest.approx(float(agg_loss(base, mask, mode, loss_scale_factor=SCALE)), rel=1e-12)


def test_without_global_counts_micro_batches_normalise_locally(randn, ragged_mask):
    loss, mask = randn(4, 6), ragged_mask(4, 6)
    part = agg_loss(loss[:2], mask[:2], "token-mean")
    expected = loss[:2].numpy()[mask[:2].numpy() > 0].mean()
    assert float(part) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_no_gradient_and_no_nan_from_masked_tokens(randn, ragged_mask, mode):
    loss, mask = randn(5, 6), ragged_mask(5, 6, min_len=2)
    mask[2, -1] = 0.0
    poisoned = loss.clone()
    poisoned[mask == 0] = float("inf")
    poisoned.requires_grad_(True)
    out = agg_loss(poisoned, mask, mode, loss_scale_factor=SCALE)
    out.backward()
    assert torch.isfinite(out)
    assert torch.all(poisoned.grad[mask == 0] == 0)
    assert torch.all(poisoned.grad[mask > 0] != 0)


def test_sum_norm_needs_a_constant_scale(randn, ragged_mask):
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(randn(2, 3), ragged_mask(2, 3), "seq-mean-token-sum-norm")


def test_sum_norm_ignores_padded_width(randn, ragged_mask):
    loss, mask = randn(3, 5), ragged_mask(3, 5)
    padded = torch.cat([loss, torch.zeros(3, 7, dtype=loss.dtype)], 1)
    padded_mask = torch.cat([mask, torch.zeros(3, 7, dtype=mask.dtype)], 1)
    a = agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=SCALE)
    b = agg_loss(padded, padded_mask, "seq-mean-token-sum-norm", loss_scale_factor=SCALE)
    assert float(a) == float(b)


def test_unknown_mode_lists_modes(randn, ragged_mask):
    with pytest.raises(ValueError, match="Did you mean 'token-mean'"):
        agg_loss(randn(2, 3), ragged_mask(2, 3), "token_mean")


def test_global_batch_info_counts(ragged_mask):
    mask = ragged_mask(5, 4)
    mask[1] = 0
    info = global_batch_info(mask, loss_scale_factor=8)
    assert info == {"global_num_tokens": int(mask.sum()), "global_num_seqs": 4, "loss_scale_factor": 8}
