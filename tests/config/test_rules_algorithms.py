"""The keys GDPO, the optimal token baseline and DRO cannot run without are checked before anything loads."""

import pytest

from lathe.config import ConfigError, load_config

A = "actor_rollout_ref.actor"


def fails(overrides):
    with pytest.raises(ConfigError) as err:
        load_config("base", ["trainer.test_freq=-1", *overrides], device_count=1)
    return str(err.value)


def test_gdpo_needs_its_reward_keys():
    text = fails(["algorithm.adv_estimator=gdpo"])
    assert "algorithm.gdpo_reward_keys" in text and "Fix:" in text
    cfg = load_config("base", ["trainer.test_freq=-1", "algorithm.adv_estimator=gdpo",
                               "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]"], device_count=1)
    assert cfg.algorithm.gdpo_reward_keys == ["accuracy_reward", "format_reward"]


def test_gdpo_weights_one_per_key():
    text = fails(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]",
                  "algorithm.gdpo_reward_weights=[1.0]"])
    assert "gdpo_reward_weights=[1.0] has 1 weights for 2" in text


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_otb_needs_sum_pi_squared(estimator):
    text = fails([f"algorithm.adv_estimator={estimator}"])
    assert f"{A}.calculate_sum_pi_squared=true" in text
    load_config("base", ["trainer.test_freq=-1", f"algorithm.adv_estimator={estimator}",
                         f"{A}.calculate_sum_pi_squared=true"], device_count=1)


@pytest.mark.parametrize("beta", [None, 0.0])
def test_dro_needs_a_positive_beta(beta):
    overrides = [f"{A}.policy_loss.loss_mode=dro"] + ([f"{A}.policy_loss.dro_beta={beta}"] if beta is not None else [])
    assert f"{A}.policy_loss.dro_beta > 0" in fails(overrides)
