"""Tests for lathe.train.optim: AdamW from `optim.*` keys and the warm-up / cosine learning-rate schedule."""

import math
from types import SimpleNamespace

import pytest
import torch

from lathe.train.optim import build_optimizer, build_scheduler, warmup_steps

LR = 0.5


def _optim_cfg(**kw):
    base = dict(lr=LR, betas=[0.8, 0.95], weight_decay=0.1, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0,
                min_lr_ratio=0.0, lr_scheduler_type="constant", warmup_style=None)
    return SimpleNamespace(**{**base, **kw})


def _lrs(cfg, total_steps, steps):
    """The learning rate in force at RL steps 0 .. steps-1 (the scheduler is stepped once per RL step)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_build_optimizer_reads_keys_and_skips_frozen_params():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    opt = build_optimizer([a, b], _optim_cfg())
    assert isinstance(opt, torch.optim.AdamW)
    group = opt.param_groups[0]
    assert group["params"] == [a]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (LR, (0.8, 0.95), 0.1)


def test_warmup_steps_explicit_or_ratio():
    assert warmup_steps(_optim_cfg(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5), 100) == 3
    assert warmup_steps(_optim_cfg(lr_warmup_steps=-1, lr_warmup_steps_ratio=0.25), 10) == 2
    assert warmup_steps(_optim_cfg(lr_warmup_steps=None, lr_warmup_steps_ratio=0.1), 50) == 5
    assert warmup_steps(_optim_cfg(), 10) == 0


def test_constant_without_warmup():
    assert _lrs(_optim_cfg(), 10, 6) == [LR] * 6


def test_linear_warmup_then_constant():
    W = 4
    lrs = _lrs(_optim_cfg(lr_warmup_steps=W), 20, 8)
    expected = [LR * (k + 1) / (W + 1) for k in range(W)] + [LR] * 4
    assert lrs == pytest.approx(expected)
    assert all(x < y for x, y in zip(lrs[:W + 1], lrs[1:W + 1]))   # strictly rising, never 0
    assert lrs[0] > 0


@pytest.mark.parametrize("key", ["lr_scheduler_type", "warmup_style"])
def test_cosine_after_warmup_decays_to_min_ratio(key):
    W, T, MIN = 2, 10, 0.1
    kw = {"lr_scheduler_type": None, key: "cosine"}
    lrs = _lrs(_optim_cfg(lr_warmup_steps=W, min_lr_ratio=MIN, **kw), T, T + 3)
    for k, lr in enumerate(lrs):
        if k < W:
            expected = LR * (k + 1) / (W + 1)
        else:
            progress = min(1.0, (k - W) / (T - W))
            expected = LR * (MIN + (1 - MIN) * (1 + math.cos(math.pi * progress)) / 2)
        assert lr == pytest.approx(expected), k
    assert lrs[W] == pytest.approx(LR)                       # full lr right after warm-up
    assert lrs[W + (T - W) // 2] == pytest.approx(LR * (1 + MIN) / 2)   # half-way: the mean of max and min
    assert lrs[T:] == pytest.approx([LR * MIN] * 3)          # floor held after the last step
    assert all(x >= y for x, y in zip(lrs[W:], lrs[W + 1:]))


def test_cosine_default_min_ratio_reaches_zero():
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine"), 4, 5)
    assert lrs[0] == pytest.approx(LR) and lrs[2] == pytest.approx(LR / 2) and lrs[4] == pytest.approx(0.0, abs=1e-12)


def test_cosine_num_cycles_waves_like_verl():
    T = 8
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine", num_cycles=1.0), T, T + 1)
    expected = [LR * 0.5 * (1 + math.cos(2 * math.pi * k / T)) for k in range(T + 1)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[T // 2] == pytest.approx(0.0, abs=1e-12) and lrs[T] == pytest.approx(LR)   # down and back up
