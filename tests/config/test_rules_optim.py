"""lathe.config.rules_optim and the optimizer keys at load_config: verl's `optim.optimizer` / `optimizer_impl` /
`override_optimizer_config` act (no longer refused), and what is wrong with them shows without importing torch."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from lathe.config import ConfigError, load_config
from lathe.config.rules_optim import module_installed
from lathe.config.sft import load_sft_config

A = "actor_rollout_ref.actor.optim"


def load(*overrides: str):
    return load_config("base", list(overrides), device_count=1)


def test_another_optimizer_and_its_arguments_load_without_a_notice():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(f"{A}.optimizer=SGD", f"+{A}.override_optimizer_config.momentum=0.9",
                   f"+{A}.override_optimizer_config.nesterov=true", "critic.optim.optimizer=Adam",
                   "critic.optim.optimizer_impl=torch.optim")
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.optimizer, optim.override_optimizer_config) == ("SGD", {"momentum": 0.9, "nesterov": True})


@pytest.mark.parametrize("override, where, fix", [
    (f"{A}.optimizer_impl=torch.optm", f"`{A}.optimizer_impl`=torch.optm: no module of that name is installed",
     "Fix: name an installed module, e.g. torch.optim"),
    (f"{A}.optimizer_impl=no_such_package.optim", f"`{A}.optimizer_impl`=no_such_package.optim", "or install the"),
    (f"{A}.optimizer_impl=torch..optim", f"`{A}.optimizer_impl`='torch..optim' is not a module name",
     "Fix: name the module"),
    (f"{A}.optimizer=Adam-W", f"`{A}.optimizer`='Adam-W' is not a class name", "Fix: name a class of torch.optim"),
    (f"+{A}.override_optimizer_config.params=1", f"`{A}.override_optimizer_config`={{'params': 1}}",
     "Fix: remove params"),
])
def test_what_shows_without_the_class_is_refused_at_load_naming_the_key_and_the_fix(override, where, fix):
    with pytest.raises(ConfigError) as err:
        load(override)
    assert where in str(err.value) and fix in str(err.value), str(err.value)


def test_the_check_imports_neither_torch_nor_the_module():
    code = ("import sys\nfrom lathe.config import load_config, ConfigError\n"
            f"load_config('base', ['{A}.optimizer=SGD', '{A}.optimizer_impl=torch.optim'], device_count=1)\n"
            f"try:\n    load_config('base', ['{A}.optimizer_impl=torch.optm'], device_count=1)\n"
            "except ConfigError:\n    pass\n"
            "bad = [m for m in ('torch', 'torch.optim') if m in sys.modules]\nprint(bad)\nsys.exit(1 if bad else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_module_installed_finds_submodules_on_the_path():
    assert module_installed("json") and module_installed("email.mime")
    assert module_installed("email.no_such_module") is False and module_installed("no_such_package_x") is False
    assert module_installed("os.path") is True            # (imported already)


def test_the_critics_optimizer_is_checked_when_a_critic_trains():
    load("critic.optim.optimizer_impl=torch.optm", "algorithm.adv_estimator=grpo")          # no critic
    with pytest.raises(ConfigError, match="`critic.optim.optimizer_impl`=torch.optm"):
        load("critic.optim.optimizer_impl=torch.optm", "algorithm.adv_estimator=gae")


def test_megatrons_adam_is_adamw_and_its_eps_an_argument():
    cfg = load("actor_rollout_ref.actor.strategy=megatron", f"{A}.optimizer=adam", f"{A}.eps=1e-5")
    optim = cfg.actor_rollout_ref.actor.optim
    assert optim.optimizer == "AdamW" and optim.override_optimizer_config == {"eps": 1e-5}
    assert load(f"{A}.optimizer=adam").actor_rollout_ref.actor.optim.optimizer == "adam"    # FSDP: torch's Adam
    assert load(f"{A}.eps=1e-8").actor_rollout_ref.actor.optim.override_optimizer_config is None   # verl's default
    both = load(f"+{A}.override_optimizer_config.momentum=0.5", f"{A}.eps=1e-6").actor_rollout_ref.actor.optim
    assert both.override_optimizer_config == {"momentum": 0.5, "eps": 1e-6}


def test_megatrons_cpu_optimizer_settings_have_no_effect_and_say_so():
    keys = [f"+{A}.override_optimizer_config.{k}" for k in ("optimizer_offload_fraction=1",
                                                             "overlap_cpu_optimizer_d2h_h2d=true")]
    with pytest.warns(UserWarning, match=r"optimizer_offload_fraction, overlap_cpu_optimizer_d2h_h2d have no effect"):
        load(*keys)


def test_lathe_sft_takes_the_same_keys():
    cfg = load_sft_config(None, ["optim.optimizer=SGD", "+optim.override_optimizer_config.momentum=0.9"])
    assert (cfg.optim.optimizer, cfg.optim.override_optimizer_config) == ("SGD", {"momentum": 0.9})
    with pytest.raises(ConfigError, match="`optim.optimizer_impl`=torch.optm: no module .* Fix: name an installed"):
        load_sft_config(None, ["optim.optimizer_impl=torch.optm"])


# -- the learning-rate schedule: Megatron's keys are lathe's own (lathe.train.optim.schedule_rate) ---------------------

def test_megatrons_schedule_keys_load_in_lathe_train_and_sft():
    """A verl Megatron script's schedule (lr_decay_style and the keys it reads) loads as lathe's schedule, for the
    actor, the critic and `lathe sft` (verl's SFT Megatron scripts: cosine to min_lr from lr_warmup_init)."""
    keys = ["lr_decay_style=WSD", "lr_wsd_decay_steps=20", "lr_wsd_decay_style=minus_sqrt", "lr_decay_steps=100",
            "lr_warmup_init=1e-7", "min_lr=1e-7"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(*(f"{A}.{k}" for k in keys), *(f"critic.optim.{k}" for k in keys))
        sft = load_sft_config(None, ["optim.lr=1e-5", "optim.lr_decay_style=cosine", "optim.min_lr=1e-6",
                                     "optim.lr_warmup_init=0", "optim.lr_warmup_steps_ratio=0.2"])
    for optim in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        assert (optim.lr_scheduler_type, optim.lr_wsd_decay_steps, optim.min_lr) == ("WSD", 20, 1e-7)
    assert (sft.optim.lr_scheduler_type, sft.optim.min_lr) == ("cosine", 1e-6)
    assert load(f"{A}.lr_decay_style=inverse-square-root").actor_rollout_ref.actor.optim.lr_scheduler_type == \
        "inverse_square_root"                                                    # Megatron's own spelling


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.lr_decay_style=WSD"], f"`{A}.lr_wsd_decay_steps`=None. Fix: set {A}.lr_wsd_decay_steps to a positive"),
    ([f"{A}.lr_decay_style=WSD", f"{A}.lr_wsd_decay_steps=30", f"{A}.lr_decay_steps=20"],
     f"`{A}.lr_wsd_decay_steps`=30 is longer than `{A}.lr_decay_steps`=20"),
    ([f"{A}.lr_decay_steps=0"], f"`{A}.lr_decay_steps`=0: the schedule's length must be positive"),
    ([f"{A}.warmup_style=cosine", f"{A}.lr_decay_style=linear"], "name two schedules"),
    ([f"{A}.min_lr=-1e-6"], "a floor cannot be negative"),
])
def test_a_schedule_that_cannot_run_fails_at_load_naming_its_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    assert message in str(err.value)


def test_schedule_keys_the_schedule_does_not_read_are_named_in_a_warning():
    with pytest.warns(UserWarning) as caught:
        load(f"{A}.lr_scheduler_type=constant", f"{A}.min_lr=1e-7", f"{A}.lr_wsd_decay_steps=4")
    text = " ".join(str(w.message) for w in caught)
    assert f"`{A}.min_lr`=1e-07 has no effect: the learning rate is constant after warm-up" in text
    assert f"`{A}.lr_wsd_*` have no effect" in text


@pytest.mark.parametrize("overrides, message", [
    ([f"{A}.init_lr_ratio=1.5"], "the warm-up's start is a fraction of lr, from 0 to 1"),
    ([f"{A}.init_lr_ratio=0.1", f"{A}.lr_warmup_init=1e-7"], "give two starts of the warm-up"),
])
def test_a_warmup_start_that_cannot_be_fails_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(*overrides)
