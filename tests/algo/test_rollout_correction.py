import math

import numpy as np
import pytest
import torch

from lathe.algo.rollout_correction import (
    ROLLOUT_RS_OPTIONS,
    compute_offpolicy_metrics,
    compute_rollout_correction,
    parse_rollout_is_threshold,
)


@pytest.fixture
def batch(randn, ragged_mask):
    rollout = randn(8, 10) - 1.5
    old = rollout + randn(8, 10, scale=0.3)
    mask = ragged_mask(8, 10, min_len=2)
    return old, rollout, mask


def _np(*tensors):
    return [t.detach().numpy() for t in tensors]


def test_token_tis_weights_truncate_and_zero_padding(batch):
    old, rollout, mask = batch
    w, new_mask, metrics = compute_rollout_correction(old, rollout, mask, rollout_is="token", rollout_is_threshold=1.2)
    o, r, m = _np(old, rollout, mask)
    expected = np.minimum(np.exp(o - r), 1.2) * m
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-12)
    assert torch.equal(new_mask, mask) and not w.requires_grad
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(expected[m > 0].mean(), rel=1e-12)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx((np.exp(o - r)[m > 0] > 1.2).mean())


def test_sequence_tis_uses_the_product_of_ratios(batch):
    old, rollout, mask = batch
    w, _, _ = compute_rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0)
    o, r, m = _np(old, rollout, mask)
    for i in range(len(m)):
        seq_w = min(math.prod(math.exp(x) for x in (o[i] - r[i])[m[i] > 0]), 3.0)
        np.testing.assert_allclose(w[i].numpy(), seq_w * m[i], rtol=1e-10)


def test_icepop_zeroes_weights_outside_the_band_and_keeps_the_mask(batch):
    old, rollout, mask = batch
    w, new_mask, metrics = compute_rollout_correction(old, rollout, mask, rollout_is="token",
                                                      rollout_is_threshold="0.8_1.25")
    o, r, m = _np(old, rollout, mask)
    ratio = np.exp(o - r)
    inside = (ratio >= 0.8) & (ratio <= 1.25)
    np.testing.assert_allclose(w.numpy(), np.where(inside, ratio, 0.0) * m, rtol=1e-12)
    assert torch.equal(new_mask, mask)
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx((~inside)[m > 0].mean())
    assert 0 < (~inside)[m > 0].mean() < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalised_weights_average_one(batch, level):
    old, rollout, mask = batch
    w, _, metrics = compute_rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_threshold=5.0,
                                               rollout_is_batch_normalize=True)
    w, m = _np(w, mask)
    mean = w[m > 0].mean() if level == "token" else np.mean([w[i][m[i] > 0][0] for i in range(len(m))])
    assert mean == pytest.approx(1.0, rel=1e-12)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] != 1.0


def _k(lr: np.ndarray, kind: str) -> np.ndarray:
    return {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1 - lr}[kind]


def _rs_reference(o, r, m, option, lower, upper):
    """Keep-mask from the option definition: k1 bounds apply to exp(k1); k2/k3 to the value."""
    keep = np.ones_like(m, dtype=bool)
    for i in range(len(m)):
        v = m[i] > 0
        stat_tok = _k(o[i] - r[i], option[-2:])
        if option.startswith("token"):
            stats = stat_tok
        else:
            agg = {"seq_sum": np.sum, "seq_mean": np.mean, "seq_max": np.max}[option.rsplit("_", 1)[0]]
            stats = np.full(len(stat_tok), agg(stat_tok[v]))
        ok = (np.exp(stats) >= lower) & (np.exp(stats) <= upper) if lower is not None else stats <= upper
        keep[i] = ok
    return keep


RS_CASES = [("token_k1", "0.8_1.25"), ("token_k1", "0.9_1.4"), ("seq_sum_k1", "0.5_2.0"), ("seq_mean_k1", "0.95_1.05"),
            ("token_k2", 0.02), ("token_k3", 0.02), ("seq_sum_k2", 0.1), ("seq_sum_k3", 0.1),
            ("seq_mean_k2", 0.03), ("seq_mean_k3", 0.03), ("seq_max_k2", 0.08), ("seq_max_k3", 0.08)]


@pytest.mark.parametrize("option,threshold", RS_CASES)
def test_rejection_options_match_their_definitions(batch, option, threshold):
    old, rollout, mask = batch
    w, new_mask, metrics = compute_rollout_correction(old, rollout, mask, rollout_rs=option,
                                                      rollout_rs_threshold=threshold)
    o, r, m = _np(old, rollout, mask)
    lower, upper = (tuple(float(x) for x in threshold.split("_")) if isinstance(threshold, str)
                    else (None, threshold))
    keep = _rs_reference(o, r, m, option, lower, upper)
    np.testing.assert_array_equal(new_mask.numpy(), m * keep)
    assert 0 < keep[m > 0].mean() < 1  # the thresholds really split this batch
    assert w is None
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx((~keep)[m > 0].mean())
    assert f"rollout_corr/rollout_rs_{option}_mean" in metrics
    assert set(o for o, _ in RS_CASES) == set(ROLLOUT_RS_OPTIONS)


def test_combined_options_must_all_pass_and_single_k1_value_is_symmetric(batch):
    old, rollout, mask = batch
    _, both, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="token_k1,seq_mean_k3",
                                            rollout_rs_threshold="1.25,0.03")
    _, a, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    _, b, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.03)
    assert torch.equal(both, a * b)
    assert 0 < float(both.sum()) < float(a.sum())


def test_legacy_geometric_name_is_seq_mean_k1(batch):
    old, rollout, mask = batch
    _, legacy, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="geometric", rollout_rs_threshold=1.05)
    _, new, _ = compute_rollout_correction(old, rollout, mask, rollout_rs="seq_mean_k1", rollout_rs_threshold=1.05)
    assert torch.equal(legacy, new)


def test_offpolicy_metrics_match_definitions(batch):
    old, rollout, mask = batch
    metrics = compute_offpolicy_metrics(old, rollout, mask)
    o, r, m = _np(old, rollout, mask)
    v = m > 0
    lr = o - r
    assert metrics["kl"] == pytest.approx((r - o)[v].mean(), rel=1e-10)
    assert metrics["k3_kl"] == pytest.approx((np.exp(lr) - lr - 1)[v].mean(), rel=1e-10)
    assert metrics["chi2_token"] == pytest.approx((np.exp(lr) ** 2)[v].mean() - 1, rel=1e-10)
    seq_sums = np.array([lr[i][v[i]].sum() for i in range(len(m))])
    assert metrics["chi2_seq"] == pytest.approx(np.exp(2 * seq_sums).mean() - 1, rel=1e-10)
    train_mean = np.array([o[i][v[i]].mean() for i in range(len(m))])
    roll_mean = np.array([r[i][v[i]].mean() for i in range(len(m))])
    assert metrics["training_ppl"] == pytest.approx(np.exp(-train_mean).mean(), rel=1e-10)
    assert metrics["log_ppl_diff"] == pytest.approx((roll_mean - train_mean).mean(), rel=1e-10)


def test_disabled_correction_returns_no_weights_but_metrics(batch):
    old, rollout, mask = batch
    w, new_mask, metrics = compute_rollout_correction(old, rollout, mask)
    assert w is None and torch.equal(new_mask, mask)
    assert all(k.startswith("rollout_corr/") for k in metrics) and "rollout_corr/kl" in metrics


@pytest.mark.parametrize("cfg,message", [
    ({"rollout_is_treshold": 2.0}, "Did you mean 'rollout_is_threshold'"),
    ({"rollout_is": "tokens"}, "Did you mean 'token'"),
    ({"rollout_is": "token", "rollout_is_threshold": "2.0_1.0"}, "lower <= upper"),
    ({"rollout_rs": "seq_mean_k3"}, "needs algorithm.rollout_correction.rollout_rs_threshold"),
    ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.1_0.2"}, "takes one upper bound"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1.1}, "Did you mean"),
    ({"rollout_rs": "token_k1,seq_sum_k1", "rollout_rs_threshold": "1,2,3"}, "one per rollout_rs option"),
    ({"loss_type": "ppo"}, "loss_type"),
])
def test_bad_configuration_is_explained(batch, cfg, message):
    with pytest.raises(ValueError, match=message):
        compute_rollout_correction(*batch, **cfg)


def test_threshold_parsing():
    assert parse_rollout_is_threshold(2) == (2.0, None)
    assert parse_rollout_is_threshold("0.5_5.0") == (5.0, 0.5)
    with pytest.raises(ValueError):
        parse_rollout_is_threshold(True)


def test_probs_diff_pieces_combine_into_the_whole_batchs_statistics():
    """ProbsDiffSums over micro-batches on two 'ranks' (a reduce that adds or maxes the ranks' values) equals
    rollout_probs_diff of the whole batch."""
    from lathe.algo.rollout_correction import ProbsDiffSums, rollout_probs_diff
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(12, 9, generator=g, dtype=torch.float64) * 3
    rollout = old + 0.2 * torch.randn(12, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(12, 9, generator=g) > 0.3
    ranks = [ProbsDiffSums(), ProbsDiffSums()]
    for rank, rows in ((0, slice(0, 4)), (0, slice(4, 7)), (1, slice(7, 12))):
        ranks[rank].add(old[rows], rollout[rows], mask[rows])

    def reduce(values, op="sum"):
        n, total, squares, top = ranks[1].sums.tolist()
        other = {3: [n, total, squares], 1: [top]}[len(values)]
        pairs = torch.tensor([values, other], dtype=torch.float64)
        return pairs.sum(0) if op == "sum" else pairs.amax(0)
    got, want = ranks[0].metrics(reduce), rollout_probs_diff(old, rollout, mask)
    assert set(got) == {"max", "mean", "std"} and got["max"] == want["max"]
    for k in ("mean", "std"):
        assert got[k] == pytest.approx(want[k], rel=1e-9)
    assert ProbsDiffSums().metrics() == {}


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_correction_pieces_of_micro_batches_and_ranks_give_the_whole_batchs_weights_and_metrics(rollout_is):
    """An on-policy update's correction (`in_update`): weights micro-batch by micro-batch are the whole batch's, and
    the pieces of two 'ranks' (a gather returning both ranks' combined moments; one rank's micro-batches trimmed to a
    narrower response width, as a packed micro-batch may be) give `compute_rollout_correction`'s metrics of the whole
    batch; with no mismatch at all, spreads and divergences are exactly 0."""
    from lathe.algo.rollout_correction import ROLLOUT_CORRECTION_KEYS, CorrectionPieces, _combine, in_update, \
        is_weights
    cfg = {**ROLLOUT_CORRECTION_KEYS, "rollout_is": rollout_is, "rollout_is_threshold": 1.3}
    assert in_update(cfg) and not in_update({**cfg, "rollout_rs": "token_k1"}) \
        and not in_update({**cfg, "rollout_is_batch_normalize": True}) and not in_update({**cfg, "rollout_is": None}) \
        and not in_update({**cfg, "bypass_mode": True}) and not in_update(None)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(12, 9, generator=g) * 3
    rollout = old + 0.2 * torch.randn(12, 9, generator=g)
    mask = torch.rand(12, 9, generator=g) > 0.3
    mask[7:, 6:] = False                                         # rank 1's rows end early
    weights, _, want = compute_rollout_correction(old, rollout, mask, **cfg)
    ranks = [CorrectionPieces(cfg), CorrectionPieces(cfg)]
    for rank, rows, width in ((0, slice(0, 4), 9), (0, slice(4, 7), 9), (1, slice(7, 12), 6)):
        o, r, m = old[rows, :width], rollout[rows, :width], mask[rows, :width]
        assert torch.allclose(is_weights(o, r, m, cfg), weights[rows, :width], rtol=1e-6, atol=0)
        ranks[rank].add(o, r, m)
    got = ranks[0].metrics(lambda local: [local, _combine(ranks[1].pieces)])
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-6, abs=1e-9), k
    assert ranks[1].metrics(lambda local: None) == {}            # a rank that sent its rows to another
    assert CorrectionPieces(cfg).metrics() == {}
    same = CorrectionPieces(cfg)
    for rows in (slice(0, 5), slice(5, 12)):
        same.add(old[rows], old[rows], mask[rows])
    got = same.metrics()
    for k in ("rollout_is_std", "rollout_is_seq_std", "rollout_is_seq_max_deviation", "kl", "k3_kl", "chi2_token",
              "chi2_seq", "log_ppl_abs_diff"):
        assert got[f"rollout_corr/{k}"] == 0.0, k


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(10, 7, generator=g) * 3
    return old, old + 0.2 * torch.randn(10, 7, generator=g), torch.rand(10, 7, generator=g) > 0.3


def _two_ranks(rank: int, port: int, root: str, queue) -> None:
    from helpers import gloo_rank

    def work():
        from lathe.algo.rollout_correction import ROLLOUT_CORRECTION_KEYS, CorrectionPieces
        from lathe.train import parallel
        old, rollout, mask = _batch()
        pieces = CorrectionPieces({**ROLLOUT_CORRECTION_KEYS, "rollout_is": "token"})
        rows = slice(0, 6) if rank == 0 else slice(6, 10)                      # different rows on each rank
        pieces.add(old[rows], rollout[rows], mask[rows])
        torch.save(pieces.metrics(lambda local: parallel.gather_objects(local)), f"{root}/rank{rank}.pt")
    gloo_rank(rank, 2, port, queue, work, 60)


def test_two_ranks_holding_different_rows_give_the_whole_batchs_metrics_on_the_first(tmp_path):
    """`parallel.gather_objects` over 2 gloo ranks: the first rank's metrics are the whole batch's, the other's none
    (the driver reads the first rank's)."""
    from helpers import spawn_saving_ranks
    from lathe.algo.rollout_correction import ROLLOUT_CORRECTION_KEYS
    old, rollout, mask = _batch()
    _, _, want = compute_rollout_correction(old, rollout, mask, **{**ROLLOUT_CORRECTION_KEYS, "rollout_is": "token"})
    first, other = spawn_saving_ranks(_two_ranks, 2, tmp_path, [__name__, "lathe.algo.rollout_correction"], 60)
    assert other == {} and set(first) == set(want)
    for k, v in want.items():
        assert first[k] == pytest.approx(float(v), rel=1e-6, abs=1e-9), k

