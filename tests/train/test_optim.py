"""Tests for lathe.train.optim: the optimizer verl's `optim.*` keys choose (against updates written out by hand) and
the warm-up / cosine learning-rate schedule."""

import math
from types import SimpleNamespace

import pytest
import torch

from helpers import assert_close_rel, rel_error
from lathe.config import ConfigError
from lathe.train.optim import build_optimizer, build_scheduler, warmup_steps

LR = 0.5


def _optim_cfg(**kw):
    base = dict(lr=LR, betas=[0.8, 0.95], weight_decay=0.1, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0,
                min_lr_ratio=0.0, lr_scheduler_type="constant", warmup_style=None, min_lr=0.0, lr_warmup_init=0.0,
                lr_decay_steps=None, lr_wsd_decay_steps=None, lr_wsd_decay_style="exponential", init_lr_ratio=None)
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
    assert warmup_steps(_optim_cfg(lr_warmup_steps=0, lr_warmup_steps_ratio=0.1), 50) == 5    # verl: <= 0 defers
    assert warmup_steps(_optim_cfg(lr_decay_steps=200, lr_warmup_steps_ratio=0.1), 50) == 20  # Megatron: of decay
    assert warmup_steps(_optim_cfg(), 10) == 0


# -- the learning-rate schedule against verl's two, written out here from their formulas: ---------------------------
# verl.utils.torch_functional's get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup (FSDP), and
# Megatron's OptimizerParamScheduler.get_lr, which verl's Megatron backend builds from lr_warmup_init, min_lr,
# lr_decay_steps (null: the run's steps), lr_decay_style and lr_wsd_* (its warm-up: lr_warmup_steps when > 0, else
# the ratio x lr_decay_steps). Both are stepped once per update, the first update taking step 0's rate.

def verl_fsdp_factor(step, *, warm, total, style, min_ratio=0.0, cycles=0.5, zero_indexed=True, init_ratio=0.0):
    if style == "constant":
        return step / max(1.0, warm) if step < warm else 1.0
    if not zero_indexed:
        step += 1
    if step < warm:
        return init_ratio + (1.0 - init_ratio) * step / max(1, warm)
    progress = (step - warm) / max(1, total - warm)
    x = math.cos(math.pi * cycles * 2.0 * progress)
    return max(min_ratio, x * (1 - min_ratio) * 0.5 + (1 + min_ratio) * 0.5)


def megatron_lr(n, *, peak, init, floor, warm, decay, style, wsd=None, wsd_style="exponential"):
    if warm > 0 and n <= warm:
        return init + (peak - init) * n / warm
    if style == "constant":
        return peak
    if n > decay:
        return floor
    if style == "inverse-square-root":
        return max(floor, peak * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
    ratio = (n - warm) / (decay - warm)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:                                                   # WSD
        anneal = decay - wsd
        if n <= anneal:
            coeff = 1.0
        else:
            r = (n - anneal) / wsd
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return floor + coeff * (peak - floor)


def test_constant_without_warmup():
    assert _lrs(_optim_cfg(), 10, 6) == [LR] * 6


def test_linear_warmup_then_constant_as_verl():
    W = 4
    lrs = _lrs(_optim_cfg(lr_warmup_steps=W), 20, 8)
    assert lrs == pytest.approx([LR * verl_fsdp_factor(k, warm=W, total=20, style="constant") for k in range(8)])
    assert lrs[:W + 1] == pytest.approx([0.0, LR / 4, LR / 2, 3 * LR / 4, LR])   # verl's first update: rate 0


@pytest.mark.parametrize("key", ["lr_scheduler_type", "warmup_style"])
@pytest.mark.parametrize("zero_indexed", [True, False])
def test_cosine_after_warmup_decays_to_min_ratio_as_verl(key, zero_indexed):
    W, T, MIN = 2, 10, 0.1
    kw = {"lr_scheduler_type": None, key: "cosine", "zero_indexed_step": zero_indexed}
    lrs = _lrs(_optim_cfg(lr_warmup_steps=W, min_lr_ratio=MIN, **kw), T, T)
    want = [LR * verl_fsdp_factor(k, warm=W, total=T, style="cosine", min_ratio=MIN, zero_indexed=zero_indexed)
            for k in range(T)]
    assert lrs == pytest.approx(want, abs=1e-12)
    if zero_indexed:
        assert lrs[W] == pytest.approx(LR)                                  # full lr right after warm-up
        assert lrs[W + (T - W) // 2] == pytest.approx(LR * (1 + MIN) / 2)   # half-way: the mean of max and min
    assert all(x >= y for x, y in zip(lrs[W:], lrs[W + 1:]))


def test_init_lr_ratio_starts_the_warmup_as_verls_cosine():
    W, T = 4, 12
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine", lr_warmup_steps=W, init_lr_ratio=0.1), T, T)
    assert lrs == pytest.approx([LR * verl_fsdp_factor(k, warm=W, total=T, style="cosine", init_ratio=0.1)
                                 for k in range(T)], abs=1e-12)
    assert lrs[0] == pytest.approx(0.1 * LR)


def test_the_built_in_demo_warms_up_from_a_sixth_of_its_lr():
    """lathe's own preset: its first updates at lr/6, 2 lr/6, ... (what it was tuned with), through init_lr_ratio."""
    from lathe.config import load_config
    optim = load_config(None, []).actor_rollout_ref.actor.optim
    assert _lrs(optim, 100, 6) == pytest.approx([optim.lr * (k + 1) / 6 for k in range(6)], rel=1e-9)


def test_past_its_last_step_the_cosine_holds_its_floor():
    """verl's cosine (num_cycles 0.5) rises again past the run's last step; lathe holds the floor, as Megatron."""
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine", min_lr_ratio=0.1), 10, 14)
    assert lrs[10:] == pytest.approx([0.1 * LR] * 4)


MEGATRON = [  # (lr_decay_style, extra keys, the run's steps)
    ("constant", dict(lr_warmup_steps=3, lr_warmup_init=0.1), 12),
    ("linear", dict(lr_warmup_steps=3, min_lr=0.05), 12),
    ("linear", dict(lr_warmup_steps_ratio=0.25, lr_decay_steps=8, min_lr=0.05), 12),     # decays over part of the run
    ("cosine", dict(lr_warmup_steps=2, lr_warmup_init=0.2, min_lr=0.05, lr_decay_steps=20), 12),
    ("inverse-square-root", dict(lr_warmup_steps=4, min_lr=0.1), 30),
    ("inverse_square_root", dict(), 6),
    ("WSD", dict(lr_warmup_steps=2, lr_wsd_decay_steps=4, min_lr=0.01), 12),
    ("WSD", dict(lr_wsd_decay_steps=5, lr_wsd_decay_style="linear", lr_decay_steps=10), 12),
    ("WSD", dict(lr_wsd_decay_steps=3, lr_wsd_decay_style="cosine"), 9),
    ("WSD", dict(lr_wsd_decay_steps=4, lr_wsd_decay_style="minus_sqrt", min_lr=0.1), 9),
]


@pytest.mark.parametrize("style, keys, total", MEGATRON)
def test_megatrons_schedules_as_its_scheduler(load_cfg, style, keys, total):
    """Megatron's keys, loaded as a verl Megatron script sets them, give Megatron's rates at every step, and the
    floor past lr_decay_steps."""
    A = "actor_rollout_ref.actor.optim"
    keys = {"lr_warmup_steps": -1, "min_lr_ratio": 0.0, "init_lr_ratio": "null", **keys}  # verl's (lathe's demo warms)
    cfg = load_cfg(f"{A}.lr={LR}", f"{A}.lr_decay_style={style}", *(f"{A}.{k}={v}" for k, v in keys.items()))
    optim = cfg.actor_rollout_ref.actor.optim
    assert optim.lr_scheduler_type == style.replace("-", "_")
    decay = keys.get("lr_decay_steps", total)
    warm = max(keys["lr_warmup_steps"], 0) or int(keys.get("lr_warmup_steps_ratio", 0.0) * decay)
    want = [megatron_lr(n, peak=LR, init=keys.get("lr_warmup_init", 0.0), floor=keys.get("min_lr", 0.0), warm=warm,
                        decay=decay, style=style.replace("_", "-"), wsd=keys.get("lr_wsd_decay_steps"),
                        wsd_style=keys.get("lr_wsd_decay_style", "exponential")) for n in range(total + 3)]
    assert _lrs(optim, total, total + 3) == pytest.approx(want, abs=1e-12)


def test_megatrons_schedules_by_hand():
    """A few of Megatron's rates worked out by hand (peak 0.5; no warm-up unless given)."""
    cfg = _optim_cfg(lr_scheduler_type="linear", min_lr=0.1, lr_decay_steps=4)
    assert _lrs(cfg, 10, 6) == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.1])
    cfg = _optim_cfg(lr_scheduler_type="inverse_square_root", lr_warmup_steps=4)
    assert _lrs(cfg, 100, 17)[16] == pytest.approx(LR / 2)           # peak x sqrt(4 / 16)
    cfg = _optim_cfg(lr_scheduler_type="WSD", lr_wsd_decay_steps=2, lr_wsd_decay_style="exponential")
    assert _lrs(cfg, 6, 8) == pytest.approx([LR] * 5 + [LR * (2 * 0.5 ** 0.5 - 1), 0.0, 0.0])
    cfg = _optim_cfg(lr_scheduler_type="constant", lr_warmup_steps=2, lr_warmup_init=0.1)
    assert _lrs(cfg, 6, 4) == pytest.approx([0.1, 0.3, 0.5, 0.5])


def test_cosine_default_min_ratio_reaches_zero():
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine"), 4, 5)
    assert lrs[0] == pytest.approx(LR) and lrs[2] == pytest.approx(LR / 2) and lrs[4] == pytest.approx(0.0, abs=1e-12)


def test_cosine_num_cycles_waves_like_verl():
    T = 8
    lrs = _lrs(_optim_cfg(lr_scheduler_type="cosine", num_cycles=1.0), T, T + 1)
    expected = [LR * 0.5 * (1 + math.cos(2 * math.pi * k / T)) for k in range(T + 1)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[T // 2] == pytest.approx(0.0, abs=1e-12) and lrs[T] == pytest.approx(LR)   # down and back up


# -- verl's optimizer choice: optim.optimizer from optim.optimizer_impl, override_optimizer_config on top ------------
A = "actor_rollout_ref.actor.optim"
WD = 0.1


def _choice(optimizer="AdamW", impl="torch.optim", **override):
    return _optim_cfg(weight_decay=WD, optimizer=optimizer, optimizer_impl=impl,
                      override_optimizer_config=override or None)


def _grads(n: int, shapes=((3, 4), (4,)), seed=3) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(n)]


def _fresh(seed=0, shapes=((3, 4), (4,))) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(opt, params, grads) -> list[torch.Tensor]:
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


def test_sgd_with_momentum_from_override_optimizer_config_is_heavy_ball_sgd():
    """optimizer=SGD + override_optimizer_config={momentum: 0.9}: v <- 0.9 v + (g + wd p); p <- p - lr v, written out
    here (the reference does not call torch)."""
    params, grads = _fresh(), _grads(4)
    opt = build_optimizer(params, _choice("SGD", momentum=0.9))
    assert type(opt) is torch.optim.SGD and "betas" not in opt.param_groups[0]    # verl: betas for Adam's only
    got = _run(opt, params, grads)
    ref, velocity = [p.detach().clone() for p in _fresh()], None
    for step in grads:
        d = [g + WD * p for g, p in zip(step, ref)]
        velocity = d if velocity is None else [0.9 * v + x for v, x in zip(velocity, d)]
        ref = [p - LR * v for p, v in zip(ref, velocity)]
    assert_close_rel(dict(enumerate(got)), dict(enumerate(ref)), rel=1e-6, name="SGD with momentum")


def _adam_by_hand(grads, *, decoupled: bool, betas=(0.8, 0.95), eps=1e-8) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in _fresh()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step in enumerate(grads, 1):
        out = []
        for i, (p, g) in enumerate(zip(params, step)):
            if decoupled:
                p = p * (1 - LR * WD)
            else:
                g = g + WD * p
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0] ** t), v[i] / (1 - betas[1] ** t)
            out.append(p - LR * m_hat / (v_hat.sqrt() + eps))
        params = out
    return params


def test_adam_decays_the_weights_through_the_gradient_and_adamw_decoupled():
    grads = _grads(3)
    adam = build_optimizer(_fresh(), _choice("Adam"))
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["betas"] == (0.8, 0.95)
    got = {name: _run(build_optimizer(params, _choice(name)), params, grads)
           for name, params in (("Adam", _fresh()), ("AdamW", _fresh()))}
    assert_close_rel(dict(enumerate(got["Adam"])), dict(enumerate(_adam_by_hand(grads, decoupled=False))), rel=1e-5)
    assert_close_rel(dict(enumerate(got["AdamW"])), dict(enumerate(_adam_by_hand(grads, decoupled=True))), rel=1e-5)
    assert rel_error(torch.cat([p.flatten() for p in got["Adam"]]),
                     torch.cat([p.flatten() for p in got["AdamW"]])) > 1e-3, "L2 and decoupled decay must differ"


def test_override_optimizer_config_adds_and_overrides_arguments():
    opt = build_optimizer(_fresh(), _choice("Adam", eps=1e-3, betas=[0.5, 0.6], lr=0.25, amsgrad=True))
    group = opt.param_groups[0]
    assert (group["eps"], group["betas"], group["lr"], group["amsgrad"]) == (1e-3, (0.5, 0.6), 0.25, True)
    # Megatron's CPU-optimizer settings are no argument of any class: left out
    opt = build_optimizer(_fresh(), _choice("SGD", optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True))
    assert type(opt) is torch.optim.SGD and "optimizer_cpu_offload" not in opt.param_groups[0]


def test_a_case_insensitive_name_finds_the_one_class_it_spells():
    assert type(build_optimizer(_fresh(), _choice("adamw"))) is torch.optim.AdamW
    assert type(build_optimizer(_fresh(), _choice("sgd"))) is torch.optim.SGD      # Megatron's spelling


@pytest.mark.parametrize("cfg, where, fix", [
    (_choice("Sgdd"), f"`{A}.optimizer`=Sgdd", "name one of its optimizers"),
    (_choice("AdamW", impl="torch.optm"), f"`{A}.optimizer_impl`=torch.optm", "name an installed module"),
    (_choice("LBFGS"), f"`{A}.optimizer`=LBFGS", "steps on the gradients alone"),
    (_choice("Optimizer"), f"`{A}.optimizer`=Optimizer", "name one of torch.optim's optimizers"),
    (_choice("SGD", momentun=0.9), f"`{A}.override_optimizer_config`={{'momentun': 0.9}}",
     f"remove momentun from {A}.override_optimizer_config"),
    (_choice("SGD", eps=1e-6), "takes no argument eps", f"verl's Megatron key {A}.eps sets it there too"),
    (_choice("Rprop"), f"`{A}.weight_decay`={WD}", f"set {A}.weight_decay=0"),
])
def test_a_class_or_argument_that_cannot_run_names_the_key_and_the_fix(cfg, where, fix):
    with pytest.raises(ConfigError) as err:
        build_optimizer(_fresh(), cfg, key=A)
    message = str(err.value)
    assert where in message and "Fix:" in message and fix in message, message


def test_a_value_the_class_rejects_fails_the_check_before_a_model_loads():
    from lathe.train.optim import check_optimizer
    fsdp = SimpleNamespace(param_offload=False, optimizer_offload=False)
    check_optimizer(_choice("SGD", momentum=0.9, nesterov=True), fsdp, torch.device("cpu"), key=A, fsdp_key="f",
                    sharded=False)
    with pytest.raises(ConfigError, match=rf"`{A}`: SGD\(.*nesterov=True\) fails: Nesterov .* Fix: change what"):
        check_optimizer(_choice("SGD", nesterov=True), fsdp, torch.device("cpu"), key=A, fsdp_key="f", sharded=False)


def test_a_zero_weight_decay_is_left_out_for_a_class_without_one():
    opt = build_optimizer(_fresh(), SimpleNamespace(**{**vars(_choice("Rprop")), "weight_decay": 0.0}))
    assert type(opt) is torch.optim.Rprop


F = "actor_rollout_ref.actor.fsdp_config"


@pytest.mark.parametrize("flags, sharded, refused", [
    (dict(offload_state=True), False, f"`{F}.optimizer_offload`=true with {A}.optimizer=SGD: on one device"),
    (dict(offload_params=True), False, f"`{F}.param_offload`=true with {A}.optimizer=SGD: on one device"),
    (dict(offload_state=True), True, f"`{F}.optimizer_offload`=true with {A}.optimizer=SGD: on FSDP2 shards"),
    (dict(offload_state=True, offload_params=True), True, None),     # FSDP2's offload policy: any optimizer
    (dict(offload_params=True), True, None),
    ({}, True, None),
    ({}, False, None),
])
def test_offload_with_another_optimizer_than_lathes_adamw_is_refused_where_only_it_offloads(flags, sharded, refused):
    from lathe.train.optim import check_placement
    flags = {"offload_params": False, "offload_state": False, **flags}
    if refused is None:
        check_placement(torch.optim.SGD, {"lr": 1.0}, key=A, fsdp_key=F, sharded=sharded, **flags)
        return
    with pytest.raises(ConfigError) as err:
        check_placement(torch.optim.SGD, {"lr": 1.0}, key=A, fsdp_key=F, sharded=sharded, **flags)
    assert refused in str(err.value) and "Fix:" in str(err.value)
    # lathe's AdamW (eps too) offloads; another AdamW argument does not
    check_placement(torch.optim.AdamW, {"lr": 1.0, "eps": 1e-6}, key=A, fsdp_key=F, sharded=sharded, **flags)
    with pytest.raises(ConfigError, match=f"{A}.override_optimizer_config's amsgrad"):
        check_placement(torch.optim.AdamW, {"lr": 1.0, "amsgrad": True}, key=A, fsdp_key=F, sharded=sharded, **flags)


def test_the_sharded_path_builds_the_chosen_class_on_the_shards():
    assert type(build_optimizer(_fresh(), _choice("SGD"), sharded=True)) is torch.optim.SGD
    assert type(build_optimizer(_fresh(), _choice("SGD"), sharded=True, offload_params=True,
                                offload_state=True)) is torch.optim.SGD


# -- FSDP2 shards: the chosen class steps the DTensor shards; its checkpoint resumes in one process -----------------
SGD = (f"{A}.optimizer=SGD", f"+{A}.override_optimizer_config.momentum=0.9", f"{A}.lr=1e-2")


def sgd_actor_job(world: int, **job) -> dict:
    """`test_parallel.train` with an SGD actor on this rank; the optimizer classes the actor built join the result."""
    from unittest import mock

    import lathe.workers.actor as actor_module

    from .test_parallel import train
    built = []

    def build(*args, **kwargs):
        opt = build_optimizer(*args, **kwargs)
        built.append(type(opt).__name__)
        return opt
    with mock.patch.object(actor_module, "build_optimizer", build):
        return {**train(world, -1, overrides=SGD, **job), "built": built}


@pytest.mark.slow
def test_sgd_on_fsdp2_shards_updates_and_resumes_as_one_process(tmp_path):
    from .test_parallel import SAVED_AFTER, STEPS, assert_same_run, run_ranks, train
    [ranks] = run_ranks(2, tmp_path / "ranks", dict(save=tmp_path / "ckpt"), fn=sgd_actor_job)
    assert ranks[0]["built"] == ["SGD"] and ranks[0]["mesh"] == ((2,), ("shard",))
    one = train(1, -1, overrides=SGD)
    assert_same_run(ranks[0], one)
    resumed = train(1, -1, overrides=SGD, steps=range(SAVED_AFTER, STEPS), resume=tmp_path / "ckpt")
    assert_same_run(resumed, {"metrics": one["metrics"][SAVED_AFTER:], "weights": one["weights"]})
    fresh = train(1, -1, overrides=SGD, steps=range(SAVED_AFTER, STEPS))     # (the momentum matters: not resumed,
    assert fresh["weights"].keys() == one["weights"].keys()                   # the weights differ)
    assert rel_error(torch.cat([v.flatten() for v in fresh["weights"].values()]),
                     torch.cat([v.flatten() for v in one["weights"].values()])) > 1e-4


# -- the state made before the first step (`materialize_state`) ----------------------------------------------------
def _steps(opt, params, grads):
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = gp.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_torch_adams_state_is_made_up_front_and_trains_as_a_lazy_one(cls):
    """Made by build_optimizer (zero moments, step 0, no parameter moved); three steps after it give bit for bit what
    three steps of a lazily made state give: the same parameters and moments."""
    torch.manual_seed(0)
    init = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(3)]
    eager = [torch.nn.Parameter(t.clone()) for t in init]
    opt = build_optimizer(eager, _optim_cfg(optimizer=cls.__name__, optimizer_impl="torch.optim"))
    assert type(opt) is cls and all(p.grad is None for p in eager)
    assert [float(opt.state[p]["step"]) for p in eager] == [0.0, 0.0]
    assert all(not opt.state[p][k].any() for p in eager for k in ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(p, t) for p, t in zip(eager, init)) and opt.param_groups[0]["lr"] == LR
    lazy = [torch.nn.Parameter(t.clone()) for t in init]
    ref = cls(lazy, lr=LR, betas=(0.8, 0.95), weight_decay=0.1)
    _steps(opt, eager, grads)
    _steps(ref, lazy, grads)
    for p, q in zip(eager, lazy):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], ref.state[q][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_master_adamws_moments_are_made_up_front():
    from lathe.train.precision import PrecisionPolicy
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model.parameters(), _optim_cfg(),
                          policy=PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                        master_dtype=torch.float32))
    assert type(opt).__name__ == "MasterAdamW"
    states = [opt.state[m] for m in opt._masters()]
    assert len(states) == 2 and all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
                                    for s in states)


def test_a_class_whose_state_does_not_start_at_zero_keeps_its_own_first_step():
    p = torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer([p], _optim_cfg(optimizer="SGD", optimizer_impl="torch.optim",
                                          override_optimizer_config={"momentum": 0.9}))
    assert not opt.state
