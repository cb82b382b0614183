"""lathe.config.rules_reward: the batch reward manager's rules and the arguments the user's function gets."""

import pytest

from lathe.config import ConfigError, load_config
from lathe.config.rules_reward import is_batch_manager, reward_fn_kwargs

BATCH = ["reward_model.reward_manager=batch", "custom_reward_function.path=/tmp/my_batch_reward.py"]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_the_batch_manager_needs_a_function_file():
    text = refused("reward_model.reward_manager=batch")
    assert "reward_model.reward_manager=batch calls the user's function once per batch" in text
    assert "Fix: set custom_reward_function.path" in text and "or set reward_manager=naive" in text


def test_the_batch_manager_gets_both_sets_of_arguments():
    cfg = load_config(None, [*BATCH, "+reward_model.reward_kwargs.max_resp_len=4", "data.max_response_length=8",
                             "+reward_model.reward_kwargs.judge_url=http://x", "+reward.reward_kwargs.bonus=0.5"])
    assert is_batch_manager(cfg)
    assert reward_fn_kwargs(cfg) == {"max_resp_len": 4, "judge_url": "http://x", "bonus": 0.5}


def test_verl_s_newer_spelling_chooses_the_batch_manager():
    cfg = load_config(None, ["reward.reward_manager.name=batch", "reward.custom_reward_function.path=/tmp/r.py",
                             "+reward.custom_reward_function.reward_kwargs.bonus=1"])
    assert is_batch_manager(cfg) and reward_fn_kwargs(cfg) == {"bonus": 1}


def test_an_argument_the_two_sets_give_different_values_is_refused_naming_both():
    text = refused(*BATCH, "+reward_model.reward_kwargs.bonus=1", "+custom_reward_function.reward_kwargs.bonus=2")
    assert ("reward_model.reward_kwargs and reward.reward_kwargs (custom_reward_function.reward_kwargs) give "
            "different values for bonus: 1 vs 2") in text and "set each argument in one of them" in text
    cfg = load_config(None, [*BATCH, "+reward_model.reward_kwargs.bonus=1", "+reward.reward_kwargs.bonus=1"])
    assert reward_fn_kwargs(cfg) == {"bonus": 1}


def test_per_row_managers_keep_their_own_arguments_out_of_the_function():
    cfg = load_config(None, ["+reward_model.reward_kwargs.max_resp_len=16", "data.max_response_length=16",
                             "+reward.reward_kwargs.bonus=1", "custom_reward_function.path=/tmp/r.py"])
    assert reward_fn_kwargs(cfg) == {"bonus": 1}            # max_resp_len is DAPO's, not the function's
    text = refused("+reward_model.reward_kwargs.judge_url=http://x")
    assert "`reward_model.reward_kwargs`=" in text and "naive and prime take none" in text
    assert "set reward_model.reward_manager=batch, which passes these to the function too" in text
    assert "max_resp_len is data.max_response_length" in refused("+reward_model.reward_kwargs.max_resp_len=16",
                                                                  "data.max_response_length=8")


def test_an_empty_reward_fn_key_is_refused_and_another_column_is_accepted():
    assert "data.reward_fn_key='' names no column" in refused("data.reward_fn_key=''")
    assert load_config(None, ["data.reward_fn_key=ability"]).data.reward_fn_key == "ability"


def test_other_managers_are_still_refused():
    text = refused("reward_model.reward_manager=limited")
    assert "`reward_model.reward_manager`=limited" in text and "set it to naive (or batch" in text
