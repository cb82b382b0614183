"""Rollout correction: importance weights and rejection masks for rollout/trainer policy mismatch.

The rollout engine samples from ``pi_rollout`` (its own kernels, precision, maybe stale weights); training
assumes ``pi_old``. With ``log r = log pi_old - log pi_rollout`` per token (Liu, Li et al. 2025, "When Speed
Kills Stability", https://richardli.xyz/rl-collapse; Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"):

* IS weights (``rollout_is``): ``token`` ``w_t = r_t``; ``sequence`` ``w = prod_t r_t`` broadcast to the
  row. ``rollout_is_threshold`` = one number -> truncated IS (TIS, ``min(w, upper)``); ``"lower_upper"``
  (e.g. ``"0.5_5.0"``) -> IcePop: weights outside the band are set to 0 (the mask is not changed).
  Weights are safety-bounded by ``exp(+-20)``, 0 on padding, detached, optionally batch-normalised to mean 1.
* Rejection sampling (``rollout_rs``, comma-separated, all must pass): a token/sequence is masked out when
  a divergence statistic leaves its bounds. Statistics per token: ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
  ``k3 = r - 1 - log r``; options ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``, ``seq_mean_k{1,2,3}``
  (``seq_mean_k1`` is the geometric-mean ratio test, "Geo-RS"), ``seq_max_k{2,3}``. k1 options take ratio
  bounds ``"lower_upper"`` (a single number u means ``1/u`` to u) applied to ``exp(k1)`` (verl's convention); k2/k3
  options take one upper bound. Legacy names ``token``/``sequence``/``geometric`` map to
  ``token_k1``/``seq_sum_k1``/``seq_mean_k1``.
* Bypass mode (``bypass_mode=True``): the trainer sets ``old_log_prob := rollout_log_prob`` and skips the
  old-policy forward; the correction is then computed inside the loss against the current policy (see
  ``lathe.algo.bypass``). ``loss_type`` picks ``ppo_clip`` or ``reinforce`` there.
* In an on-policy update (one epoch over one mini-batch), ``pi_old`` is the policy being updated, so IS weights
  without batch normalisation or rejection (``in_update``) are computed inside the update from its own forward's
  detached log-probs (``is_weights``, micro-batch by micro-batch), and the old-policy forward is saved: the same
  weights in exact arithmetic, and the same ``rollout_corr/*`` metrics (``CorrectionPieces``).

All metrics are floats under ``rollout_corr/`` (verl's names).
"""

from __future__ import annotations

import math

import torch

from lathe.algo.registry import unknown_name_error
from lathe.algo.utils import masked_mean, masked_sum

__all__ = [
    "ROLLOUT_RS_OPTIONS",
    "ROLLOUT_CORRECTION_KEYS",
    "compute_rollout_correction",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_offpolicy_metrics",
    "CorrectionPieces",
    "in_update",
    "is_weights",
    "parse_rollout_is_threshold",
    "rollout_probs_diff",
]

SAFETY_BOUND = 20.0
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip
_LEGACY_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
ROLLOUT_CORRECTION_KEYS: dict = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}
_KEY = "algorithm.rollout_correction"


def _bounds(spec, key: str) -> tuple[float, float | None]:
    """Parse ``u`` or ``"l_u"`` into (upper, lower or None); both must be positive and l <= u."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{_KEY}.{key}={spec!r} must be a number or a 'lower_upper' string like '0.5_2.0'")
    text = str(spec).strip()
    try:
        parts = [float(x) for x in text.split("_")] if "_" in text else [float(text)]
    except ValueError:
        raise ValueError(f"{_KEY}.{key}={spec!r} is not a number or a 'lower_upper' string like '0.5_2.0'") from None
    upper, lower = (parts[0], None) if len(parts) == 1 else (parts[1], parts[0])
    if len(parts) > 2 or upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{_KEY}.{key}={spec!r}: need positive bounds with lower <= upper")
    return upper, lower


def parse_rollout_is_threshold(spec) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> (upper, lower); lower is None for TIS, set for IcePop."""
    return _bounds(spec, "rollout_is_threshold")


def _parse_rs(rollout_rs: str, threshold) -> dict[str, tuple[float, float | None]]:
    options = []
    for opt in (o.strip() for o in str(rollout_rs).split(",")):
        opt = _LEGACY_RS.get(opt, opt)
        if opt and opt not in ROLLOUT_RS_OPTIONS:
            raise unknown_name_error("rejection-sampling option", f"{_KEY}.rollout_rs", opt, ROLLOUT_RS_OPTIONS)
        if opt and opt not in options:
            options.append(opt)
    if threshold is None:
        raise ValueError(f"{_KEY}.rollout_rs={rollout_rs!r} needs {_KEY}.rollout_rs_threshold (e.g. '0.5_2.0')")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"{_KEY}.rollout_rs_threshold={threshold!r}: give one value or one per rollout_rs option")
    specs = specs * len(options) if len(specs) == 1 else specs
    out = {}
    for opt, spec in zip(options, specs, strict=True):
        upper, lower = _bounds(spec, "rollout_rs_threshold")
        if opt.endswith("k1"):
            out[opt] = (upper, 1.0 / upper if lower is None else lower)
        elif lower is not None:
            raise ValueError(f"{_KEY}.rollout_rs_threshold={spec!r}: option '{opt}' takes one upper bound")
        else:
            out[opt] = (upper, None)
    return out


def _vals(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return x[valid].double()


def _mean(x: torch.Tensor) -> float:
    """Mean as a float; 0.0 for an empty selection (a fully rejected or empty micro-batch)."""
    return float(x.double().mean()) if x.numel() else 0.0


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


def _min(x: torch.Tensor) -> float:
    return float(x.min()) if x.numel() else 0.0


def _mmm(prefix: str, values: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}_mean": _mean(values), f"{prefix}_max": _max(values), f"{prefix}_min": _min(values)}


def _is_metrics(weights, raw, log_w, mask, level, upper, lower) -> dict[str, float]:
    valid, seq_valid = mask.bool(), mask.bool().any(dim=-1)
    low = 1.0 / upper if lower is None else lower
    m = _mmm("rollout_is", _vals(weights, valid))
    per = _vals(raw, valid) if level == "token" else log_w[seq_valid].double().exp()
    m["rollout_is_ratio_fraction_high"] = _mean(per > upper)
    m["rollout_is_ratio_fraction_low"] = _mean(per < low)
    w = _vals(weights, valid).clamp(0.0, upper)
    m["rollout_is_std"] = float(w.std(unbiased=False)) if w.numel() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / _mean((w / (w.mean() + 1e-8)) ** 2) if w.numel() else 0.0
    seq = masked_mean(weights, mask, dim=-1)[seq_valid].double()
    m.update(_mmm("rollout_is_seq", seq))
    m["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    m["rollout_is_seq_max_deviation"] = _max((seq - 1).abs())
    if lower is not None:
        m["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper))[valid])
    return m


def _weights(log_ratio, response_mask, rollout_is, upper, lower):
    """(weights, raw ratios, per-row log-weights or None) of the module doc's IS levels; no host reads."""
    mask = response_mask.to(log_ratio.dtype)
    log_w = masked_sum(log_ratio, response_mask, dim=-1) if rollout_is == "sequence" else None
    per = log_ratio if log_w is None else log_w.unsqueeze(-1).expand_as(log_ratio)
    raw = torch.exp(per.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return weights, raw, log_w


def in_update(cfg: dict | None) -> bool:
    """Whether an on-policy update computes this correction itself (module doc): IS weights (token or sequence
    level, TIS or IcePop) without batch normalisation, no rejection sampling (it changes the mask that the loss's
    token counts come from before the update starts), not bypass mode (which has no pi_old pass to save)."""
    return bool(cfg) and cfg.get("rollout_is") in ("token", "sequence") and cfg.get("rollout_rs") is None \
        and not cfg.get("rollout_is_batch_normalize") and not cfg.get("bypass_mode")


@torch.no_grad()
def is_weights(old_log_prob, rollout_log_prob, response_mask, cfg: dict) -> torch.Tensor:
    """The IS weights (B, T) of `in_update`'s corrections, without metrics (no host read: an update's micro-batches
    queue without waiting); `compute_rollout_correction`'s weights for the same rows."""
    upper, lower = parse_rollout_is_threshold(cfg.get("rollout_is_threshold", 2.0))
    return _weights(old_log_prob - rollout_log_prob, response_mask, cfg["rollout_is"], upper, lower)[0]


@torch.no_grad()
def compute_rollout_correction_weights(log_ratio, response_mask, rollout_is="token", rollout_is_threshold=2.0,
                                       rollout_is_batch_normalize=False):
    """IS weights (B, T) from ``log_ratio = log pi_old - log pi_rollout`` and their ``rollout_is_*`` metrics."""
    if rollout_is not in ("token", "sequence"):
        raise unknown_name_error("IS level", f"{_KEY}.rollout_is", rollout_is, ("token", "sequence", "null"))
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    weights, raw, log_w = _weights(log_ratio, response_mask, rollout_is, upper, lower)
    metrics = _is_metrics(weights, raw, log_w, response_mask, rollout_is, upper, lower)
    if rollout_is_batch_normalize:
        seq_valid = response_mask.bool().any(dim=-1)
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            mean = masked_mean(weights, response_mask, dim=-1)[seq_valid].mean()
        factor = float(mean) if float(mean) > 1e-8 else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights.detach(), metrics


def _rs_statistic(opt: str, log_ratio, response_mask):
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stat = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}[opt[-2:]]
    if opt.startswith("token"):
        return stat, "token"
    if opt.startswith("seq_sum"):
        return masked_sum(stat, response_mask, dim=-1), "sequence"
    if opt.startswith("seq_mean"):
        return masked_mean(stat, response_mask, dim=-1), "sequence"
    neg_inf = torch.full_like(stat, float("-inf"))
    seq_max = torch.where(response_mask.bool(), stat, neg_inf).max(dim=-1).values
    return torch.where(torch.isinf(seq_max), torch.zeros_like(seq_max), seq_max), "sequence"


@torch.no_grad()
def compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs="token_k1", rollout_rs_threshold=None):
    """Response mask with rejected tokens/sequences zeroed, and ``rollout_rs_*`` metrics."""
    specs = _parse_rs(rollout_rs, rollout_rs_threshold)
    valid, seq_valid = response_mask.bool(), response_mask.bool().any(dim=-1)
    keep_all = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for opt, (upper, lower) in specs.items():
        stat, level = _rs_statistic(opt, log_ratio, response_mask)
        hi, lo = (math.log(upper), math.log(lower)) if lower is not None else (upper, None)
        keep = (stat <= hi) & (stat >= lo) if lo is not None else stat <= hi
        keep = keep if level == "token" else keep.unsqueeze(-1).expand_as(valid)
        values = _vals(stat, valid) if level == "token" else stat[seq_valid].double()
        pre = f"rollout_rs_{opt}"
        metrics.update(_mmm(pre, values))
        metrics[f"{pre}_fraction_high"] = _mean(values > hi)
        metrics[f"{pre}_fraction_low"] = _mean(values < lo) if lo is not None else 0.0
        metrics[f"{pre}_masked_fraction"] = _mean(~keep[valid])
        metrics[f"{pre}_seq_masked_fraction"] = _mean(((~keep) & valid).any(-1)[seq_valid])
        keep_all &= keep
    metrics["rollout_rs_masked_fraction"] = _mean(~keep_all[valid])
    metrics["rollout_rs_seq_masked_fraction"] = _mean(((~keep_all) & valid).any(-1)[seq_valid])
    return (response_mask * keep_all.to(response_mask.dtype)).to(response_mask.dtype), metrics


@torch.no_grad()
def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask) -> dict[str, float]:
    """Mismatch diagnostics: KL(rollout || old) estimates, perplexities, chi-square divergences."""
    seq_valid = response_mask.bool().any(dim=-1)
    old_mean = masked_mean(old_log_prob.double(), response_mask, dim=-1)[seq_valid]
    m = {"training_ppl": _mean(torch.exp(-old_mean)), "training_log_ppl": _mean(-old_mean)}
    if rollout_log_prob is None:
        return m
    lr = (old_log_prob - rollout_log_prob).double()
    roll_mean = masked_mean(rollout_log_prob.double(), response_mask, dim=-1)[seq_valid]
    diff = roll_mean - old_mean
    lr_safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = masked_sum(lr, response_mask, dim=-1)[seq_valid].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    m.update({
        "kl": float(masked_mean(-lr, response_mask)),
        "k3_kl": float(masked_mean(torch.exp(lr) - lr - 1, response_mask)),
        "rollout_ppl": _mean(torch.exp(-roll_mean)),
        "rollout_log_ppl": _mean(-roll_mean),
        "log_ppl_diff": _mean(diff),
        "log_ppl_abs_diff": _mean(diff.abs()),
        "log_ppl_diff_max": _max(diff),
        "log_ppl_diff_min": _min(diff),
        "ppl_ratio": _mean(torch.exp(diff)),
        "chi2_token": float(masked_mean(torch.exp(lr_safe) ** 2, response_mask) - 1.0),
        "chi2_seq": _mean(torch.exp(2.0 * seq_sum)) - 1.0,
    })  # fmt: skip
    return m


@torch.no_grad()
def _probs_diff(old_log_prob, rollout_log_prob, response_mask) -> torch.Tensor:
    return (rollout_log_prob.double().exp() - old_log_prob.double().exp()).abs()[response_mask.bool()]


@torch.no_grad()
def rollout_probs_diff(old_log_prob, rollout_log_prob, response_mask) -> dict[str, float]:
    """verl's rollout/trainer consistency check, ``|exp(log pi_rollout) - exp(log pi_old)|`` per valid token:
    ``{"max", "mean", "std"}`` (nothing when no token is valid). Large values mean the engine sampled from another
    distribution than the trainer computes (stale weights, precision, a bug)."""
    diff = _probs_diff(old_log_prob, rollout_log_prob, response_mask)
    if not diff.numel():
        return {}
    return {"max": float(diff.max()), "mean": float(diff.mean()),
            "std": float(diff.std()) if diff.numel() > 1 else 0.0}


class ProbsDiffSums:
    """`rollout_probs_diff` gathered piece by piece (micro-batches, ranks): count, sum, sum of squares and max in
    float64, so the pieces combine into the statistics of the whole batch. `reduce` takes a function that sums (or
    maxes) float64 values over the ranks (`lathe.train.parallel.all_reduce`)."""

    def __init__(self):
        self.sums: torch.Tensor | None = None      # (count, sum, sum of squares, max), float64 on the device

    @torch.no_grad()
    def add(self, old_log_prob, rollout_log_prob, response_mask) -> None:
        """Adds on the device (no host read, no boolean indexing), so that micro-batches queue without waiting."""
        mask = response_mask.bool()
        diff = torch.where(mask, (rollout_log_prob.double().exp() - old_log_prob.double().exp()).abs(), 0.0)
        piece = torch.stack([mask.sum().double(), diff.sum(), diff.square().sum(), diff.max() if diff.numel()
                             else diff.new_zeros(())])
        self.sums = piece if self.sums is None else torch.cat([self.sums[:3] + piece[:3],
                                                               torch.maximum(self.sums[3:], piece[3:])])

    def metrics(self, reduce=None) -> dict[str, float]:
        n, total, squares, top = [0.0] * 4 if self.sums is None else self.sums.tolist()
        if reduce is not None:
            n, total, squares = reduce([n, total, squares]).tolist()
            top = float(reduce([top], op="max")[0])
        if not n:
            return {}
        mean = total / n
        var = max(0.0, (squares - n * mean * mean) / (n - 1)) if n > 1 else 0.0     # torch.std's (n - 1)
        return {"max": top, "mean": mean, "std": var ** 0.5}


class CorrectionPieces:
    """An on-policy update's correction metrics (`in_update`), piece by piece (micro-batches, ranks): each piece of
    rows (pi_old, pi_rollout, response mask) becomes, on the device and without a host read, the count, mean, sum of
    squared deviations, max and min of each per-token or per-row quantity that `compute_rollout_correction`'s metrics
    average or bound (`_STREAMS`); pieces combine exactly (Chan et al.'s pairwise update), so `metrics` gives the
    whole batch's `rollout_corr/*` metrics (within float64 rounding) from O(1) numbers a rank: every rank's when it is
    given `gather` (a function returning every rank's object on one rank, None on the others, `lathe.train.parallel.
    gather_objects`; only that rank computes them, as the driver reads the first rank's metrics)."""

    def __init__(self, cfg: dict):
        self.cfg = {**ROLLOUT_CORRECTION_KEYS, **cfg}
        self.upper, self.lower = parse_rollout_is_threshold(self.cfg["rollout_is_threshold"])
        self.pieces: list[torch.Tensor] = []           # (streams, 5) float64 each, on the device

    @torch.no_grad()
    def add(self, old_log_prob, rollout_log_prob, response_mask) -> None:
        valid = response_mask.bool()
        rows = valid.any(dim=-1)
        level, upper, lower = self.cfg["rollout_is"], self.upper, self.lower
        log_ratio = old_log_prob - rollout_log_prob
        weights, raw, log_w = _weights(log_ratio, response_mask, level, upper, lower)
        per, per_valid = (raw.double(), valid) if level == "token" else (log_w.double().exp(), rows)
        low = 1.0 / upper if lower is None else lower
        seq = masked_mean(weights, response_mask, dim=-1).double()
        old_mean = masked_mean(old_log_prob.double(), response_mask, dim=-1)
        roll_mean = masked_mean(rollout_log_prob.double(), response_mask, dim=-1)
        diff = roll_mean - old_mean
        lr = log_ratio.double()
        seq_sum = masked_sum(lr, response_mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        streams = {"w": (weights.double(), valid), "high": ((per > upper).double(), per_valid),
                   "low": ((per < low).double(), per_valid), "seq": (seq, rows),
                   "oob": (((raw < (lower or 0.0)) | (raw > upper)).double(), valid),
                   "neg_old": (-old_mean, rows), "exp_neg_old": (torch.exp(-old_mean), rows),
                   "neg_lr": (-lr, valid), "k3": (torch.exp(lr) - lr - 1, valid),
                   "chi2_token": (torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)) ** 2, valid),
                   "neg_roll": (-roll_mean, rows), "exp_neg_roll": (torch.exp(-roll_mean), rows),
                   "diff": (diff, rows), "abs_diff": (diff.abs(), rows), "exp_diff": (torch.exp(diff), rows),
                   "chi2_seq": (torch.exp(2.0 * seq_sum), rows)}
        assert tuple(streams) == _STREAMS
        self.pieces.append(torch.stack([_moments(v, ok) for v, ok in streams.values()]))

    def metrics(self, gather=None) -> dict[str, float]:
        local = _combine([p.cpu() for p in self.pieces])
        parts = gather(local) if gather is not None else [local]
        if parts is None:                                   # another rank gathers and computes them
            return {}
        parts = [p for p in parts if p is not None]
        if not parts:
            return {}
        st = dict(zip(_STREAMS, _combine(parts).tolist()))
        mean = {k: (v[1] if v[0] else 0.0) for k, v in st.items()}
        top = {k: (v[3] if v[0] else 0.0) for k, v in st.items()}
        bottom = {k: (v[4] if v[0] else 0.0) for k, v in st.items()}
        n_w, _, m2_w, _, _ = st["w"]
        squares = m2_w + n_w * mean["w"] ** 2
        n_seq, _, m2_seq, _, _ = st["seq"]
        m = {"rollout_is_mean": mean["w"], "rollout_is_max": top["w"], "rollout_is_min": bottom["w"],
             "rollout_is_ratio_fraction_high": mean["high"], "rollout_is_ratio_fraction_low": mean["low"],
             "rollout_is_std": (max(0.0, m2_w / n_w) ** 0.5) if n_w > 1 else 0.0,
             "rollout_is_eff_sample_size": ((n_w * (mean["w"] + 1e-8) ** 2 / squares if squares else math.inf)
                                            if n_w else 0.0),
             "rollout_is_seq_mean": mean["seq"], "rollout_is_seq_max": top["seq"], "rollout_is_seq_min": bottom["seq"],
             "rollout_is_seq_std": (max(0.0, m2_seq / (n_seq - 1)) ** 0.5) if n_seq > 1 else 0.0,
             "rollout_is_seq_max_deviation": max(abs(top["seq"] - 1), abs(bottom["seq"] - 1)) if n_seq else 0.0}
        if self.lower is not None:
            m["rollout_is_oob_ratio"] = mean["oob"]
        m.update({"training_ppl": mean["exp_neg_old"], "training_log_ppl": mean["neg_old"], "kl": mean["neg_lr"],
                  "k3_kl": mean["k3"], "rollout_ppl": mean["exp_neg_roll"], "rollout_log_ppl": mean["neg_roll"],
                  "log_ppl_diff": mean["diff"], "log_ppl_abs_diff": mean["abs_diff"], "log_ppl_diff_max": top["diff"],
                  "log_ppl_diff_min": bottom["diff"], "ppl_ratio": mean["exp_diff"],
                  "chi2_token": mean["chi2_token"] - 1.0, "chi2_seq": mean["chi2_seq"] - 1.0})
        return {f"rollout_corr/{k}": float(v) for k, v in m.items()}


_STREAMS = ("w", "high", "low", "seq", "oob", "neg_old", "exp_neg_old", "neg_lr", "k3", "chi2_token", "neg_roll",
            "exp_neg_roll", "diff", "abs_diff", "exp_diff", "chi2_seq")


def _moments(values: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """(count, mean, sum of squared deviations, max, min) of `values` where `ok`, float64, on their device; no host
    read (max and min are -inf and inf over nothing)."""
    v, n = values.double(), ok.sum().double()
    if not v.numel():
        return torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf], dtype=torch.float64, device=v.device)
    mean = torch.where(ok, v, 0.0).sum() / n.clamp(min=1)
    m2 = torch.where(ok, (v - mean) ** 2, 0.0).sum()
    return torch.stack([n, mean, m2, torch.where(ok, v, -math.inf).max(), torch.where(ok, v, math.inf).min()])


def _combine(pieces: list[torch.Tensor]) -> torch.Tensor | None:
    """`_moments` rows of several pieces as one (Chan, Golub and LeVeque's pairwise update), on the CPU."""
    out = None
    for p in pieces:
        p = p.double().cpu()
        if out is None:
            out = p.clone()
            continue
        na, nb = out[:, 0], p[:, 0]
        n = na + nb
        delta = p[:, 1] - out[:, 1]
        share = torch.where(n > 0, nb / n.clamp(min=1), 0.0)
        out = torch.stack([n, out[:, 1] + delta * share,
                           out[:, 2] + p[:, 2] + delta ** 2 * na * share,
                           torch.maximum(out[:, 3], p[:, 3]), torch.minimum(out[:, 4], p[:, 4])], dim=1)
    return out


def _check_cfg(cfg: dict) -> dict:
    unknown = [k for k in cfg if k not in ROLLOUT_CORRECTION_KEYS]
    if unknown:
        raise unknown_name_error("rollout_correction key", f"{_KEY} key", unknown[0], ROLLOUT_CORRECTION_KEYS)
    full = {**ROLLOUT_CORRECTION_KEYS, **cfg}
    if full["loss_type"] not in ("ppo_clip", "reinforce"):
        raise unknown_name_error("bypass loss type", f"{_KEY}.loss_type", full["loss_type"], ("ppo_clip", "reinforce"))
    return full


@torch.no_grad()
def compute_rollout_correction(old_log_prob, rollout_log_prob, response_mask, **cfg):
    """One entry point: ``(is_weights or None, modified_response_mask, metrics)``.

    ``cfg`` takes verl's ``algorithm.rollout_correction.*`` keys (``ROLLOUT_CORRECTION_KEYS`` with their
    defaults); unknown keys raise. IS weights are None when ``rollout_is`` is None; the mask is the input
    mask with rejected tokens zeroed (unchanged when ``rollout_rs`` is None). Metrics are always computed.
    """
    full = _check_cfg(cfg)
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"rollout correction: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must match"
        )
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if full["rollout_is"] is not None:
        weights, is_m = compute_rollout_correction_weights(
            log_ratio, response_mask, full["rollout_is"], full["rollout_is_threshold"],
            full["rollout_is_batch_normalize"],
        )  # fmt: skip
        metrics.update(is_m)
    mask = response_mask.clone()
    if full["rollout_rs"] is not None:
        mask, rs_m = compute_rollout_rejection_mask(log_ratio, response_mask, full["rollout_rs"],
                                                    full["rollout_rs_threshold"])
        metrics.update(rs_m)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
