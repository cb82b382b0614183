"""lathe.config.rules_pf_ppo and the PF-PPO keys: accepted where they act, refused with the key, value and fix where
they cannot."""

import warnings

import pytest

from lathe.config import ConfigError, load_config
from lathe.config.errors import IgnoredKeysWarning


GAE = ("algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true")


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


@pytest.mark.parametrize("method", ["pow", "max_min", "max_random"])
def test_pf_ppo_with_gae_loads_without_a_warning(method):
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        cfg = load_config(None, [*GAE, f"algorithm.pf_ppo.reweight_method={method}", "algorithm.pf_ppo.weight_pow=1.5"])
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pf_ppo.reweight_method == method
    assert cfg.algorithm.pf_ppo.weight_pow == 1.5


def test_an_unknown_reweight_method_names_the_key_and_the_methods():
    text = refused(*GAE, "algorithm.pf_ppo.reweight_method=max-min")
    assert "algorithm.pf_ppo.reweight_method=max-min is not one of the values this key takes." in text
    assert "Did you mean `max_min`?" in text and "max_random" in text


def test_pf_ppo_with_another_estimator_is_refused_as_verl_ignores_it_there():
    text = refused("algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true")
    assert "algorithm.use_pf_ppo=true with algorithm.adv_estimator=grpo" in text
    assert "Fix: set algorithm.adv_estimator=gae" in text
    load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.pf_ppo.reweight_method=max_min"])  # off: no rule


@pytest.mark.parametrize("power", ["-1.0", "inf", "nan"])
def test_a_weight_power_that_gives_no_finite_weight_is_refused(power):
    text = refused(*GAE, f"algorithm.pf_ppo.weight_pow={power}")
    assert f"algorithm.pf_ppo.weight_pow={float(power)} with reweight_method=pow" in text
    assert "Fix: use a finite weight_pow >= 0" in text
    load_config(None, [*GAE, "algorithm.pf_ppo.reweight_method=max_min", f"algorithm.pf_ppo.weight_pow={power}"])
