"""`lathe.data.sft`: verl's SFT rows as token ids with a loss mask, checked token by token on a rendered
conversation with a Qwen-style (ChatML) template, and every bad row named with its fix."""

from __future__ import annotations

import json
import os

import pytest

from lathe.config.sft import load_sft_config
from lathe.data.builtin import builtin_tokenizer
from lathe.data.errors import DataError
from lathe.data.sft import SFTDataset

from helpers import qwen_style_tokenizer

CONVERSATION = [
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "Let me compute."},
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "It is 42."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return qwen_style_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def data_cfg(*overrides: str):
    return load_sft_config(None, list(overrides)).data


def full(example) -> tuple[list[int], list[int]]:
    return example.prompt_ids + example.response_ids, [0] * len(example.prompt_ids) + example.loss_mask


def trained_spans(tok, ids, mask) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    spans, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            spans.append(tok.decode(run)), run.clear()
    return spans + ([tok.decode(run)] if run else [])


def test_a_conversation_trains_the_assistant_turns_token_by_token(tmp_path, qwen_tokenizer):
    tok = qwen_tokenizer
    files = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ex = SFTDataset(files, tok, data_cfg("data.max_length=4096"))[0]
    ids, mask = full(ex)
    # the tokens are the whole conversation's rendering, tokenized at once
    assert ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    # trained: each assistant turn's content and its end marker, never its header, the system/user/tool turns
    assert trained_spans(tok, ids, mask) == ["Let me compute.<|im_end|>\n", "It is 42.<|im_end|>\n",
                                             "You're welcome.<|im_end|>\n"]
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for k in range(len(ids)):                       # every trained run starts right after an assistant header
        if mask[k] and not mask[k - 1]:
            assert ids[k - len(header):k] == header
    assert ex.prompt_ids == ids[:len(ex.prompt_ids)] and ex.loss_mask[0] == 1


def test_verls_older_multiturn_keys_and_a_messages_column_chosen_by_the_columns(tmp_path, qwen_tokenizer):
    rows = [{"conv": CONVERSATION[:2], "question": "unused"}]
    files = write_jsonl(tmp_path / "c.jsonl", rows)
    old = load_sft_config(None, ["data.multiturn.enable=true", "data.multiturn.messages_key=conv"]).data
    a = SFTDataset(files, qwen_tokenizer, old)[0]
    files2 = write_jsonl(tmp_path / "d.jsonl", [{"conv": CONVERSATION[:2]}])     # no prompt column: multi-turn
    b = SFTDataset(files2, qwen_tokenizer, data_cfg("data.messages_key=conv"))[0]
    assert full(a) == full(b)
    assert trained_spans(qwen_tokenizer, *full(a)) == ["Let me compute.<|im_end|>\n"]


def test_single_turn_rows_train_the_response_and_eos_as_verls_gsm8k_recipe_reads_them(tmp_path):
    tok = builtin_tokenizer()
    rows = [{"extra_info": {"question": "2+2=", "answer": "4"}}, {"extra_info": {"question": "9-3=", "answer": 6}}]
    files = write_jsonl(tmp_path / "g.jsonl", rows)
    cfg = data_cfg("data.prompt_key=extra_info", "data.prompt_dict_keys=[question]",
                   "data.response_key=extra_info", "data.response_dict_keys=[answer]")
    ds = SFTDataset(files, tok, cfg)
    for ex, row in zip(ds, rows):
        prompt = tok.apply_chat_template([{"role": "user", "content": row["extra_info"]["question"]}],
                                         add_generation_prompt=True, tokenize=False)
        assert ex.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
        assert tok.decode(ex.response_ids) == f"{row['extra_info']['answer']}<|endoftext|>"
        assert ex.loss_mask == [1] * len(ex.response_ids)


def test_the_builtin_default_reads_the_arithmetic_answers():
    ds = SFTDataset("builtin:arithmetic", builtin_tokenizer(), data_cfg())
    ex = ds[0]
    assert len(ds) > 100 and builtin_tokenizer().decode(ex.response_ids).endswith("<|endoftext|>")


@pytest.mark.parametrize("rows, overrides, match", [
    ([{"q": "a", "answer": "b"}], [], r"no 'prompt' column .* set data.prompt_key"),
    ([{"prompt": "a", "extra_info": {"solution": "b"}}], [], r"extra_info.answer: no 'answer' in \['solution'\]"),
    ([{"prompt": "a", "extra_info": {"answer": ""}}], [], r"must be a non-empty string"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], [], r"has no assistant turn"),
    ([{"messages": [{"role": "user"}]}], [], r"messages\[0\]: expected \{role: str, content: str\}"),
    ([{"prompt": "a", "extra_info": {"answer": "b" * 40}}], ["data.max_length=30"],
     r"more than data.max_length=30. Fix: raise data.max_length, or set data.truncation"),
])
def test_a_bad_row_is_named_with_its_fix(tmp_path, rows, overrides, match):
    files = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "extra_info": {"answer": "ok"}}, *rows])
    with pytest.raises(DataError, match=match) as err:
        SFTDataset(files, builtin_tokenizer(), data_cfg(*overrides))
    assert f"{tmp_path / 'bad.jsonl'} line 2: " in str(err.value)


def test_truncation_keeps_the_start_or_the_end(tmp_path):
    tok = builtin_tokenizer()
    files = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x", "extra_info": {"answer": "0123456789" * 4}}])
    whole = full(SFTDataset(files, tok, data_cfg())[0])[0]
    right = SFTDataset(files, tok, data_cfg("data.max_length=20", "data.truncation=right"))
    left = SFTDataset(files, tok, data_cfg("data.max_length=20", "data.truncation=left"))
    assert full(right[0])[0] == whole[:20] and full(left[0])[0] == whole[-20:]
    assert right.num_truncated == left.num_truncated == 1


GSM8K = "/work/shared/data/gsm8k/test.jsonl"


@pytest.mark.skipif(not os.path.exists(GSM8K), reason=f"{GSM8K} is not on this machine")
def test_raw_gsm8k_rows_read_with_verls_default_keys():
    ds = SFTDataset(GSM8K, builtin_tokenizer(), data_cfg("data.prompt_key=question", "data.response_key=answer",
                                                         "data.response_dict_keys=null", "data.max_length=2048"),
                    max_samples=20)
    assert len(ds) == 20 and all("####" in builtin_tokenizer().decode(e.response_ids) for e in ds)


@pytest.mark.parametrize("row, overrides, match", [
    ({"q": "a", "answer": "b"}, [], r"no 'prompt' column for the prompt \(the first row's keys \['answer', 'q'\]\). "
                                    r"Fix: set data.prompt_key"),
    ({"prompt": "a", "answer": "b"}, [], r"no 'extra_info' column for the response .*Fix: set data.response_key"),
    ({"prompt": "a", "extra_info": {"solution": "b"}}, [], r"extra_info.answer: no 'answer' in \['solution'\]"),
    ({"prompt": "a", "answer": "b"}, ["data.response_key=answer"], r"answer.answer: no 'answer' in a column that is "
                                                                   r"not a struct. Fix: set data.response_dict_keys"),
    ({"prompt": "a"}, ["data.multiturn.enable=true"], r"no 'messages' column for the messages .*data.messages_key"),
])
def test_check_columns_names_the_file_the_key_and_the_fix(tmp_path, row, overrides, match):
    from lathe.data.files import peek
    from lathe.data.sft import check_columns
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=rf"{path} \(data.train_files\): {match}"):
        check_columns(peek(path), data_cfg(*overrides), "data.train_files")


def test_check_columns_passes_the_rows_sft_reads(tmp_path):
    from lathe.data.files import peek
    from lathe.data.sft import check_columns
    check_columns(peek("builtin:arithmetic"), data_cfg(), "data.train_files")
    conversation = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    check_columns(peek(conversation), data_cfg(), "data.train_files")
