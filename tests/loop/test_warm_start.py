"""`lathe train`'s warm start (lathe.loop.warm_start): its examples from `extra_info.answer`, the reply text (the
arithmetic demo) or the turns after the prompt (the agent demo: a tool call, the tool's answer, the reply)."""

from __future__ import annotations

import pytest

from lathe.config import load_config
from lathe.data.builtin import builtin_tokenizer
from lathe.data.secret_lookup import TOOL_CALL
from lathe.loop.setup import load_datasets
from lathe.loop.warm_start import warm_start_examples


def examples(preset: str, *overrides: str):
    cfg = load_config(preset, list(overrides))
    tok = builtin_tokenizer()
    train, _ = load_datasets(cfg, tok)
    return tok, train, warm_start_examples(cfg, tok, train)


def test_a_text_answer_trains_its_tokens_and_eos():
    tok, train, out = examples("default")
    prompt, response = out[0]                       # a pair: every token of the answer is trained
    assert prompt == train[0]["prompt_ids"]
    assert tok.decode(response) == train[0]["extra_info"]["answer"] + "<|endoftext|>"


def test_turns_after_the_prompt_train_the_assistant_turns_and_not_the_tool_answer():
    tok, train, out = examples("default", "data.train_files=builtin:secret_lookup", "data.val_files=null",
                               "trainer.test_freq=-1")
    i = next(i for i in range(len(train)) if train[i]["extra_info"]["answer"][0]["content"] == TOOL_CALL)
    prompt, response, mask = out[i]
    secret = train[i]["ground_truth"]
    assert prompt == train[i]["prompt_ids"]                    # the prompt the rollout starts from
    assert tok.decode(response) == f"{TOOL_CALL}<|end|><|tool|>{secret}<|end|><|assistant|>={secret}<|end|>"
    assert "".join(tok.decode([t]) for t, m in zip(response, mask) if m) == f"{TOOL_CALL}<|end|>={secret}<|end|>"


def test_a_row_without_answers_or_with_bad_turns_is_named(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "lathe/arithmetic", '
                    '"reward_model": {"ground_truth": "2"}, "extra_info": {"answer": [{"role": "user", "content": '
                    '"x"}]}}\n')
    with pytest.raises(ValueError, match=r"warm_start: .*rows.jsonl row 0: extra_info.answer has no assistant turn"):
        examples("default", f"data.train_files={rows}", "data.val_files=null", "trainer.test_freq=-1")
    rows.write_text('{"prompt": [{"role": "user", "content": "1+1="}], "data_source": "lathe/arithmetic", '
                    '"reward_model": {"ground_truth": "2"}}\n')
    with pytest.raises(ValueError, match=r"needs extra_info.answer in every training row; row 0"):
        examples("default", f"data.train_files={rows}", "data.val_files=null", "trainer.test_freq=-1")
