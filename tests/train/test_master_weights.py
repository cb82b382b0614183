"""Tests for lathe.train.master_weights: any optimizer over fp32 master weights behind a bf16 module (one device),
and exact resume of a non-AdamW optimizer through lathe.train.update's checkpoints, with and without masters.

CPU tests force the bf16 policy, as tests/train/test_master.py does (the class does not care which device)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from helpers import assert_close_rel
from lathe.train.master_weights import SteppedMasters
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.precision import FP32, PrecisionPolicy
from lathe.train.update import clipped_step, load_trainable, save_trainable

MIXED = PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, master_dtype=torch.float32)
LR, WD, MOMENTUM = 0.05, 0.1, 0.9


def _cfg(optimizer: str, **override):
    return SimpleNamespace(lr=LR, betas=[0.9, 0.95], weight_decay=WD, optimizer=optimizer, optimizer_impl="torch.optim",
                           override_optimizer_config=override or None, lr_warmup_steps=0, lr_warmup_steps_ratio=0.0,
                           lr_scheduler_type="constant", min_lr_ratio=0.0)


def _net(seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 50)).to(device)


def _backward(net: nn.Module, seed: int) -> None:
    tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(seed))
    net(tokens.to(next(net.parameters()).device)).float().logsumexp(-1).mean().backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sgd_steps_the_fp32_masters_with_the_accumulated_gradients_and_casts_them_back(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    net = _net(device=device)
    fp32 = [p.detach().clone() for p in net.parameters()]
    opt = build_optimizer(net.parameters(), _cfg("SGD", momentum=MOMENTUM), policy=MIXED)
    assert isinstance(opt, SteppedMasters) and isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "MasterSGD"
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert all(torch.equal(m, p) and m.dtype == torch.float32 for m, p in zip(opt.masters, fp32))
    ref, velocity = fp32, None
    for step in range(3):
        for micro in range(2):                      # two micro-batches: their gradients add up in fp32
            _backward(net, 10 * step + micro)
        assert all(p.grad is None for p in net.parameters()), "each bf16 gradient is freed into the fp32 buffer"
        grads = [g.clone() for g in opt.grads]
        assert all(g.dtype == torch.float32 for g in grads)
        opt.step()
        opt.zero_grad()
        d = [g + WD * p for g, p in zip(grads, ref)]             # heavy-ball SGD, written out
        velocity = d if velocity is None else [MOMENTUM * v + x for v, x in zip(velocity, d)]
        ref = [p - LR * v for p, v in zip(ref, velocity)]
    assert_close_rel(dict(enumerate(opt.masters)), dict(enumerate(ref)), rel=1e-6, name="masters")
    for p, m in zip(net.parameters(), opt.masters):
        assert torch.equal(p, m.to(torch.bfloat16)), "the module holds the masters, cast"


def test_clipping_scales_the_accumulated_gradients():
    net = _net()
    opt = build_optimizer(net.parameters(), _cfg("SGD"), policy=MIXED)
    _backward(net, 0)
    norm = torch.nn.utils.get_total_norm([g.clone() for g in opt.grads], 2.0)
    before = [m.clone() for m in opt.masters]
    grads = [g.clone() for g in opt.grads]
    clip = 0.5 * float(norm)
    assert clipped_step(net, opt, clip) == float(norm)
    scale = clip / (float(norm) + 1e-6)
    expected = [b - LR * (scale * g + WD * b) for b, g in zip(before, grads)]
    assert_close_rel(dict(enumerate(opt.masters)), dict(enumerate(expected)), rel=1e-6)


def _train(model, opt, sched, seeds) -> None:
    for seed in seeds:
        ids = torch.randint(2, 40, (3, 9), generator=torch.Generator().manual_seed(seed))
        model(ids).logits.float().logsumexp(-1).mean().backward()
        clipped_step(model, opt, 1.0)
        sched.step()


def _resume_matches(tmp_path, make_lathe, optim_cfg, policy) -> None:
    """Two steps, a checkpoint, a third step; a fresh model and optimizer resumed from the checkpoint take the same
    third step, bit for bit."""
    model = make_lathe(0)
    opt = build_optimizer(model.parameters(), optim_cfg, policy=policy)
    sched = build_scheduler(opt, optim_cfg, 10)
    _train(model, opt, sched, [1, 2])
    save_trainable(tmp_path, model, opt, sched)
    _train(model, opt, sched, [3])
    fresh = make_lathe(5)
    opt2 = build_optimizer(fresh.parameters(), optim_cfg, policy=policy)
    sched2 = build_scheduler(opt2, optim_cfg, 10)
    load_trainable(tmp_path, fresh, opt2, sched2, what="actor", ignore_missing=lambda n: n == "lm_head.weight")
    assert opt2.state_dict()["state"], "the optimizer state came back"
    _train(fresh, opt2, sched2, [3])
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    masters = getattr(opt, "masters", None)
    if masters is not None:
        assert all(torch.equal(a, b) for a, b in zip(masters, opt2.masters)), "the fp32 masters too"


def test_sgd_with_momentum_resumes_exactly_by_parameter_name(tmp_path, make_lathe):
    _resume_matches(tmp_path, make_lathe, _cfg("SGD", momentum=MOMENTUM), FP32)


def test_adam_over_master_weights_resumes_exactly(tmp_path, make_lathe):
    _resume_matches(tmp_path, make_lathe, _cfg("Adam", eps=1e-6), MIXED)
