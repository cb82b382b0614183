"""verl's `rollout.multi_turn` keys: accepted and acting with the agent loop on; every mistake fails at load, before
any model loads, naming the key and the fix."""

import warnings

import pytest

from lathe.config import ConfigError, load_config

MT = "actor_rollout_ref.rollout.multi_turn"


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("default", [f"{MT}.enable=true", *overrides])
    return str(err.value)


def test_the_agent_loop_keys_load_without_warnings(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("default", [f"{MT}.enable=true", f"{MT}.tool_config_path={tools}", f"{MT}.max_assistant_turns=4",
                                      f"{MT}.max_user_turns=3", f"{MT}.max_parallel_calls=2", f"{MT}.format=llama3_json",
                                      f"{MT}.max_tool_response_length=100", f"{MT}.tool_response_truncate_side=left",
                                      f"{MT}.tool_timeout=5"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_parallel_calls == 2


@pytest.mark.parametrize("override,text", [
    (f"{MT}.format=pythonic", "Fix: set it to hermes"),
    (f"{MT}.tool_response_truncate_side=top", "Fix: set it to left"),
    (f"{MT}.max_assistant_turns=0", "Fix: set it to 1 or more, or to null"),
    (f"{MT}.tool_timeout=0", "tool_timeout=0.0 must be positive"),
    (f"{MT}.max_tool_response_length=0", "max_tool_response_length=0 must be positive"),
    ("actor_rollout_ref.rollout.name=hf", "not implemented for transformers generate"),
    (f"{MT}.tool_config_path=/nonexistent/tools.yaml", "no such file"),
    (f"{MT}.interaction_config_path=users.yaml", "interaction_config_path='users.yaml': no such file"),
])
def test_mistakes_fail_at_load_naming_the_key(override, text):
    assert text in problems(override)


def test_multi_turn_keys_without_the_agent_loop_warn_that_they_do_nothing():
    with pytest.warns(Warning, match="max_assistant_turns"):
        load_config("default", [f"{MT}.max_assistant_turns=3"])
