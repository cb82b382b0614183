"""The built-in agent task's tool (`SecretLookupTool`, tool config `builtin:secret_lookup`) and its reward: the
tool's verdict, reaching lathe's built-in scorer through `extra_info["tool_rewards"]`."""

from __future__ import annotations

import pytest

from lathe.data.builtin import BUILTIN_DATASETS
from lathe.reward.registry import default_compute_score
from lathe.rollout.agent.builtin_tools import SecretLookupTool
from lathe.rollout.agent.parser import ToolCall
from lathe.rollout.agent.tool_config import load_tools
from lathe.rollout.agent.tools import ToolConfigError

ROW = BUILTIN_DATASETS["builtin:secret_lookup"]("train")[0]


def test_the_builtin_tool_config_answers_the_rows_secret_and_its_verdict_is_the_reward():
    tools = load_tools("builtin:secret_lookup")
    assert isinstance(tools.tools["f"], SecretLookupTool)
    assert tools.schemas()[0]["function"]["name"] == "f"
    secret, info = ROW["reward_model"]["ground_truth"], ROW["extra_info"]
    looked, skipped = tools.open("a", info["tools_kwargs"]), tools.open("b", info["tools_kwargs"])
    assert looked.call(ToolCall("f", {}), timeout_s=5).text == secret
    for session, verdict in ((looked, 1.0), (skipped, 0.0)):
        assert session.rewards().get("f", 0.0) == verdict
        extra = {**info, "tool_rewards": session.rewards()}
        assert default_compute_score(ROW["data_source"], "=0", secret, extra) == verdict   # whatever it answers
        session.close()
    assert tools.tools["f"]._instances == {}


def test_without_the_agent_loop_the_reward_says_how_to_turn_it_on():
    with pytest.raises(ValueError, match=r"multi_turn.enable=true .*tool_config_path=builtin:secret_lookup"):
        default_compute_score(ROW["data_source"], "=3", "3", {"index": 0})


def test_a_row_without_a_secret_and_an_unknown_builtin_config_are_named():
    s = load_tools("builtin:secret_lookup").open("t", None)
    result = s.call(ToolCall("f", {}), timeout_s=5)
    assert result.error and "extra_info.tools_kwargs.f.create_kwargs.secret" in result.text
    with pytest.raises(ToolConfigError, match=r"builtin:nope: no such built-in tool config; built-in: "
                                              r"builtin:secret_lookup"):
        load_tools("builtin:nope")
