import pytest

from lathe.algo.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_policy_loss,
    register_adv_estimator,
    register_policy_loss,
)

VERL_ADV = {"gae", "grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
            "remax", "opo", "gpg"}
VERL_LOSSES = {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "sapo", "geo_mean", "bypass_mode"}


def test_builtins_are_registered_under_verl_names():
    assert VERL_ADV <= set(ADV_ESTIMATORS)
    assert VERL_LOSSES <= set(POLICY_LOSSES)
    assert get_adv_estimator("grpo") is ADV_ESTIMATORS["grpo"]
    assert get_policy_loss("vanilla") is POLICY_LOSSES["vanilla"]


def test_unknown_estimator_lists_names_and_closest():
    with pytest.raises(ValueError) as err:
        get_adv_estimator("gpro")
    text = str(err.value)
    assert "algorithm.adv_estimator='gpro'" in text
    assert all(name in text for name in VERL_ADV)
    assert "Did you mean 'grpo'" in text


def test_unknown_loss_lists_names_and_closest():
    with pytest.raises(ValueError) as err:
        get_policy_loss("cispo_")
    assert "Did you mean 'cispo'" in str(err.value)
    assert "geo_mean" in str(err.value)


def test_register_new_estimator_and_loss_then_clash():
    @register_adv_estimator("test_only_adv")
    def my_adv(*, token_level_rewards, response_mask, **_):
        return token_level_rewards, token_level_rewards

    @register_policy_loss("test_only_loss")
    def my_loss(*args, **kwargs):
        return 0.0, {}

    try:
        assert get_adv_estimator("test_only_adv") is my_adv
        assert get_policy_loss("test_only_loss") is my_loss
        with pytest.raises(ValueError, match="already registered"):
            @register_adv_estimator("test_only_adv")
            def other(**_):
                return None
    finally:
        ADV_ESTIMATORS.pop("test_only_adv", None)
        POLICY_LOSSES.pop("test_only_loss", None)
