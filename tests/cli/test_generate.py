"""Tests for lathe.cli.generate (`lathe generate`) on a tiny random Qwen3 saved with the built-in tokenizer."""

import json

import pytest
import torch

from lathe.cli.generate import eos_token_ids, generate_file
from lathe.cli.generate_options import GenerateError
from lathe.cli.generate_rows import read_rows
from lathe.data.builtin import builtin_tokenizer

from helpers import assert_close_rel

MAX = 12


def save_tiny_model(path):
    """A random transformers Qwen3 whose vocabulary is the built-in char tokenizer's, saved with it; (path, model).

    Not Qwen2: transformers 5's AutoTokenizer loads any tokenizer next to a qwen2 config.json as Qwen2Tokenizer,
    whose byte-level pre-tokenizer drops the char tokenizer's spaces.
    """
    from transformers import AutoModelForCausalLM

    from models.lathe_tiny import hf_config
    tok = builtin_tokenizer()
    cfg = hf_config("qwen3")
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = len(tok), tok.eos_token_id, 0, None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("generate") / "qwen3-chars")


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _run(tiny, tmp_path, rows, *items):
    inp, out = _write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    stats = generate_file(tiny[0], inp, out, list(items))
    return [json.loads(line) for line in out.read_text().splitlines()], stats


@torch.no_grad()
def _hf_greedy(model, ids, eos):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_equals_transformers_for_text_chat_and_token_id_prompts(tiny, tmp_path):
    tok = builtin_tokenizer()
    chat = [{"role": "user", "content": "What is 12+7?"}]
    rows = [{"prompt": "12+7="}, {"prompt": chat}, {"prompt_token_ids": [40, 41, 42, 9]}, {"prompt": "Hello"}]
    got, stats = _run(tiny, tmp_path, rows, "temperature=0", f"max_tokens={MAX}", "batch_size=3")
    chat_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = [tok.encode("12+7="), tok.encode(chat_text, add_special_tokens=False), [40, 41, 42, 9],
                  tok.encode("Hello")]
    expected = [_hf_greedy(tiny[1], p, [tok.eos_token_id]) for p in prompt_ids]
    assert len({tuple(e) for e in expected}) == 4, "precondition: the prompts give different continuations"
    assert [r["index"] for r in got] == [0, 1, 2, 3]
    assert [r.get("prompt", r.get("prompt_token_ids")) for r in got] == [next(iter(r.values())) for r in rows]
    for row, exp in zip(got, expected):
        (sample,) = row["outputs"]
        assert sample["token_ids"] == exp
        assert sample["text"] == tok.decode(exp, skip_special_tokens=True)
        assert len(sample["logprobs"]) == len(exp) and all(lp <= 0 for lp in sample["logprobs"])
        assert sample["finish_reason"] == ("stop" if exp[-1] == tok.eos_token_id else "length")
    assert stats.prompts == 4 and stats.samples == 4 and stats.tokens == sum(map(len, expected))


def test_seeded_sampling_is_reproducible_and_calls_get_fresh_seeds(tiny, tmp_path):
    rows = [{"prompt": "ab"}, {"prompt": "ab"}, {"prompt": "xyz"}]
    keys = ["n=3", "temperature=1.0", "max_tokens=8", "seed=3", "batch_size=1", "ignore_eos=true"]
    first, stats = _run(tiny, tmp_path, rows, *keys)
    again, _ = _run(tiny, tmp_path, rows, *keys)
    assert again == first
    samples = [[tuple(s["token_ids"]) for s in r["outputs"]] for r in first]
    assert all(len(s) == 3 for s in samples) and stats.samples == 9
    assert len(set(samples[0])) > 1, "the n samples of a prompt differ"
    assert samples[0] != samples[1], "the same prompt in the next engine call is not given the same seeds"
    other, _ = _run(tiny, tmp_path, rows, *keys[:3], "seed=4", *keys[4:])
    assert other != first


def test_stop_string_ends_the_sample_and_the_text(tiny, tmp_path):
    tok = builtin_tokenizer()
    rows = [{"prompt": "12+7="}, {"prompt": "Hello"}]
    free, _ = _run(tiny, tmp_path, rows, "temperature=0", f"max_tokens={MAX}", "ignore_eos=true")
    free_ids = free[0]["outputs"][0]["token_ids"]
    stop = free[0]["outputs"][0]["text"][4:6]
    k = next(k for k in range(1, MAX + 1) if stop in tok.decode(free_ids[:k], skip_special_tokens=True))
    got, _ = _run(tiny, tmp_path, rows, "temperature=0", f"max_tokens={MAX}", "ignore_eos=true",
                  f"stop=[{json.dumps(stop)}]")
    sample = got[0]["outputs"][0]
    assert sample["finish_reason"] == "stop"
    assert sample["token_ids"] == free_ids[:k] and sample["text"].endswith(stop)
    assert_close_rel(sample["logprobs"], free[0]["outputs"][0]["logprobs"][:k], name="log-probs")
    assert stop not in sample["text"][:-1]


@pytest.mark.parametrize("line, field", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('{"text": "hi"}', "neither"),
    ('{"prompt": "hi", "prompt_token_ids": [1]}', "both"),
    ('{"prompt": 5}', "field 'prompt'"),
    ('{"prompt": [{"content": "hi"}]}', "field 'prompt[0]'"),
    ('{"prompt_token_ids": [1, "2"]}', "field 'prompt_token_ids'"),
    ('{"prompt": ""}', "field 'prompt'"),
])
def test_bad_rows_are_named_before_any_model_loads(tmp_path, line, field):
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(GenerateError) as e:
        generate_file(tmp_path / "no-such-model", inp, tmp_path / "out.jsonl", ["temperature=0"])
    assert str(inp) in str(e.value) and "line 2" in str(e.value) and field in str(e.value)


def test_prompts_the_model_cannot_take_are_named(tiny, tmp_path):
    for row, problem in (({"prompt_token_ids": [3, 500]}, "vocabulary"), ({"prompt": "x" * 70}, "max_model_len")):
        inp = _write(tmp_path / "in.jsonl", [{"prompt": "fine"}, row])
        with pytest.raises(GenerateError, match=f"line 2.*{problem}"):
            generate_file(tiny[0], inp, tmp_path / "out.jsonl", [])


def test_unsupported_architecture_points_to_model_check(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    inp = _write(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    with pytest.raises(GenerateError, match="GPT2LMHeadModel.*lathe model check"):
        generate_file(model, inp, tmp_path / "out.jsonl", [])


def test_eos_ids_add_generation_config_to_the_tokenizer(tmp_path):
    tok = builtin_tokenizer()
    assert eos_token_ids(tmp_path, tok) == [tok.eos_token_id]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, 6]}))
    assert eos_token_ids(tmp_path, tok) == [tok.eos_token_id, 6]


def test_read_rows_keeps_order_and_skips_blank_lines(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "a"}\n\n{"prompt_token_ids": [4]}\n')
    rows = read_rows(inp)
    assert [(r.field, r.value) for r in rows] == [("prompt", "a"), ("prompt_token_ids", [4])]
    assert rows[1].where.endswith("line 3")
