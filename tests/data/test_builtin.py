"""Tests for lathe.data.builtin: the character tokenizer, its chat template, the arithmetic task."""

import string

import pytest

from lathe.data.builtin import (
    BUILTIN_DATASETS,
    SPECIAL_TOKENS,
    arithmetic_rows,
    builtin_tokenizer,
)

TEXT = "Natalia sold 48 clips,\n\tthen 24 more: 48+24 = 72!  {ok} ~end~"


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def test_round_trip_one_token_per_character(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.decode(tok.encode(string.printable, add_special_tokens=False)) == string.printable


def test_distinct_characters_get_distinct_ids(tok):
    ids = tok.encode(string.printable, add_special_tokens=False)
    assert len(set(ids)) == len(string.printable)
    assert tok.unk_token_id not in ids


def test_unknown_character_maps_to_unk(tok):
    ids = tok.encode("aé€b", add_special_tokens=False)
    assert ids[1] == ids[2] == tok.unk_token_id
    assert ids[0] != tok.unk_token_id and ids[3] != tok.unk_token_id


def test_special_tokens(tok):
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>" and tok.unk_token == "<|unk|>"
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    # a special token in text is one id, not split into characters
    assert tok.encode("1<|end|>2", add_special_tokens=False) == [
        tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("<|end|>"), tok.convert_tokens_to_ids("2")]
    # no bos is added: what the chat template renders is exactly what gets tokenized
    assert tok.encode("ab") == tok.encode("ab", add_special_tokens=False)
    assert tok.decode(tok.encode("19<|endoftext|>", add_special_tokens=False), skip_special_tokens=True) == "19"


def test_chat_template_output(tok):
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12+7="}]
    with_prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert with_prompt == "<|system|>Add.<|end|><|user|>12+7=<|end|><|assistant|>"
    without = tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tokenize=False)
    assert without == "<|user|>12+7=<|end|>"


def test_save_and_reload_keeps_ids_and_template(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.encode(TEXT + "é<|user|>", add_special_tokens=False) == tok.encode(
        TEXT + "é<|user|>", add_special_tokens=False)
    assert loaded.decode(loaded.encode(TEXT, add_special_tokens=False)) == TEXT
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name)
    msgs = [{"role": "user", "content": "3+4="}]
    assert loaded.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_arithmetic_rows_schema_and_answers():
    rows = arithmetic_rows(200, seed=3, split="train", max_operand=12, ops=("+", "-", "*"))
    assert len(rows) == 200
    seen_ops = set()
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "lathe/arithmetic" and row["ability"] == "arithmetic"
        (msg,) = row["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith("=")
        expr = msg["content"][:-1]
        op = next(o for o in "+-*" if o in expr)
        a, b = (int(x) for x in expr.split(op))
        assert 0 <= a <= 12 and 0 <= b <= 12
        seen_ops.add(op)
        answer = row["reward_model"]["ground_truth"]
        assert answer == str(eval(expr)) and int(answer) >= 0
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"] == {"split": "train", "index": i, "answer": answer}
    assert seen_ops == {"+", "-", "*"}


def test_arithmetic_rows_deterministic_per_seed():
    assert arithmetic_rows(50, seed=7, split="train") == arithmetic_rows(50, seed=7, split="train")
    a = [r["prompt"][0]["content"] for r in arithmetic_rows(50, seed=7, split="train")]
    b = [r["prompt"][0]["content"] for r in arithmetic_rows(50, seed=8, split="train")]
    assert a != b


def test_arithmetic_rows_rejects_bad_args():
    with pytest.raises(ValueError, match="unsupported ops"):
        arithmetic_rows(5, seed=0, split="train", ops=("/",))
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_rows(5, seed=0, split="train", max_operand=0)


def test_builtin_arithmetic_splits():
    make = BUILTIN_DATASETS["builtin:arithmetic"]
    train, val = make("train"), make("val")
    assert len(train) == 4096 and len(val) == 256
    assert train[:256] != val  # different seeds
    assert val == make("val")
    assert {r["extra_info"]["split"] for r in val} == {"val"}
    with pytest.raises(ValueError, match="unknown split"):
        make("dev")
