"""`builtin:secret_lookup` (lathe.data.secret_lookup): the agent task's rows in verl's schema, its tool's kwargs, and
its warm-start conversations (`lathe sft` trains them turn by turn, tool answers masked)."""

from __future__ import annotations

import pytest

from lathe.config.sft import load_sft_config
from lathe.data.builtin import BUILTIN_DATASETS, builtin_tokenizer
from lathe.data.secret_lookup import SECRET_LOOKUP_DATA_SOURCE, TOOL_CALL, TOOL_NAME, secret_lookup_rows
from lathe.data.sft import SFTDataset


def test_rows_carry_the_secret_for_the_tool_and_the_reward():
    rows = secret_lookup_rows(200, seed=0, split="train")
    assert rows == secret_lookup_rows(200, seed=0, split="train")            # deterministic in the seed
    for row in rows:
        secret = row["reward_model"]["ground_truth"]
        assert row["data_source"] == SECRET_LOOKUP_DATA_SOURCE and secret in "0123456789"
        assert row["extra_info"]["tools_kwargs"] == {TOOL_NAME: {"create_kwargs": {"secret": secret}}}
        assert row["prompt"] == [{"role": "user", "content": f"item {row['extra_info']['index']}"}]
    calls = [r for r in rows if r["extra_info"]["answer"][0]["content"] == TOOL_CALL]
    assert 0.3 < len(calls) / len(rows) < 0.5                                   # 40% of the examples call the tool
    for row in calls:                                                           # ... read the secret and answer it
        secret = row["reward_model"]["ground_truth"]
        assert [m["role"] for m in row["extra_info"]["answer"]] == ["assistant", "tool", "assistant"]
        assert [m["content"] for m in row["extra_info"]["answer"][1:]] == [secret, "=" + secret]


def test_the_builtin_splits():
    make = BUILTIN_DATASETS["builtin:secret_lookup"]
    train, val = make("train"), make("val")
    assert len(train) == 512 and len(val) == 32 and {r["extra_info"]["split"] for r in val} == {"val"}
    secrets = [r["reward_model"]["ground_truth"] for r in val]
    assert secrets == [r["reward_model"]["ground_truth"] for r in make("test")]
    assert secrets != [r["reward_model"]["ground_truth"] for r in train[:32]]      # another seed
    with pytest.raises(ValueError, match="builtin:secret_lookup: unknown split 'dev'"):
        make("dev")
    with pytest.raises(ValueError, match="tool_share"):
        secret_lookup_rows(3, seed=0, split="train", tool_share=2.0)


def test_lathe_sft_trains_the_conversations_the_answers_continue():
    tok = builtin_tokenizer()
    ds = SFTDataset("builtin:secret_lookup", tok, load_sft_config(None, []).data)
    row = next(r for r in secret_lookup_rows(512, seed=0, split="train")
               if r["extra_info"]["answer"][0]["content"] == TOOL_CALL)
    ex = ds[row["extra_info"]["index"]]
    secret = row["reward_model"]["ground_truth"]
    assert tok.decode(ex.prompt_ids) == f"<|user|>item {row['extra_info']['index']}<|end|><|assistant|>"
    trained = "".join(tok.decode([i]) for i, m in zip(ex.response_ids, ex.loss_mask) if m)
    assert trained == f"{TOOL_CALL}<|end|>={secret}<|end|>"                     # the tool's answer is not trained
    assert tok.decode(ex.response_ids) == f"{TOOL_CALL}<|end|><|tool|>{secret}<|end|><|assistant|>={secret}<|end|>"
