"""Tests for lathe.data.dataset.RLDataset: reading, schema errors, chat template, length limits."""

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lathe.data.builtin import builtin_tokenizer
from lathe.data.dataset import RLDataset, truncate_ids
from lathe.data.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def make_row(i, content=None):
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": content or f"question number {i}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i * 3)},
        "extra_info": {"split": "train", "index": i},
    }


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def expected_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_parquet_items(tok, tmp_path):
    rows = [make_row(i) for i in range(5)]
    ds = RLDataset(write_parquet(tmp_path / "a.parquet", rows), tok)
    assert len(ds) == 5 and ds.num_filtered == 0
    for i, row in enumerate(rows):
        item = ds[i]
        assert item["prompt_ids"] == expected_ids(tok, row["prompt"])
        assert item["raw_prompt"] == row["prompt"]
        assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
        assert item["ground_truth"] == str(i * 3)
        assert item["extra_info"] == row["extra_info"]
        assert item["index"] == i
    with pytest.raises(IndexError):
        ds[5]


def test_files_concatenate_in_order(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [make_row(i) for i in range(3)])
    b = write_parquet(tmp_path / "b.parquet", [make_row(i) for i in range(10, 12)])
    c = tmp_path / "c.json"
    c.write_text(json.dumps([make_row(20)]))
    ds = RLDataset([a, b, str(c)], tok)
    assert [ds[i]["ground_truth"] for i in range(len(ds))] == ["0", "3", "6", "30", "33", "60"]
    assert [ds[i]["index"] for i in range(len(ds))] == list(range(6))


def test_home_directory_is_expanded(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "d.jsonl", [make_row(1)])
    assert RLDataset("~/d.jsonl", tok)[0]["ground_truth"] == "3"


def test_missing_file_names_it_and_the_fix(tok, tmp_path):
    with pytest.raises(DataError, match=r"nowhere\.parquet.*lathe preprocess gsm8k"):
        RLDataset(str(tmp_path / "nowhere.parquet"), tok)


def test_unsupported_extension(tok, tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n")
    with pytest.raises(DataError, match=r"x\.csv.*'\.csv'"):
        RLDataset(str(p), tok)


def _drop(key):
    return lambda r: r.pop(key)


BAD_ROWS = [
    ("missing prompt", _drop("prompt"), "'prompt'"),
    ("empty prompt", lambda r: r.update(prompt=[]), "'prompt'"),
    ("prompt a number", lambda r: r.update(prompt=5), "'prompt'"),
    ("message without content", lambda r: r["prompt"][0].pop("content"), r"'prompt\[0\]'"),
    ("message not a dict", lambda r: r.update(prompt=["hi"]), r"'prompt\[0\]'"),
    ("content not a string", lambda r: r["prompt"][0].update(content=7), r"'prompt\[0\]\.content'"),
    ("empty content", lambda r: r["prompt"][0].update(content="  "), r"'prompt\[0\]\.content'"),
    ("empty role", lambda r: r["prompt"][0].update(role=""), r"'prompt\[0\]\.role'"),
    ("missing data_source", _drop("data_source"), "'data_source'"),
    ("data_source not a string", lambda r: r.update(data_source=3), "'data_source'"),
    ("missing reward_model", _drop("reward_model"), r"'reward_model\.ground_truth'"),
    ("missing ground_truth", lambda r: r["reward_model"].pop("ground_truth"), r"'reward_model\.ground_truth'"),
    ("ability not a string", lambda r: r.update(ability=1), "'ability'"),
    ("extra_info not a dict", lambda r: r.update(extra_info=[1]), "'extra_info'"),
]


@pytest.mark.parametrize("case,mutate,field", BAD_ROWS, ids=[c[0] for c in BAD_ROWS])
def test_bad_jsonl_row_names_file_line_and_field(tok, tmp_path, case, mutate, field):
    rows = [make_row(i) for i in range(3)]
    mutate(rows[1])
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=rf"bad\.jsonl line 2: field {field}.*Fix:"):
        RLDataset(path, tok)


def test_bad_parquet_row_names_row(tok, tmp_path):
    rows = [make_row(i) for i in range(4)]
    rows[2]["prompt"][0]["content"] = ""
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad\.parquet row 2: field 'prompt\[0\]\.content'"):
        RLDataset(path, tok)


def test_invalid_json_line(tok, tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text(json.dumps(make_row(0)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken\.jsonl line 2: not valid JSON"):
        RLDataset(str(p), tok)


def test_custom_prompt_key(tok, tmp_path):
    rows = [make_row(i) for i in range(2)]
    for r in rows:
        r["messages"] = r.pop("prompt")
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    assert RLDataset(path, tok, prompt_key="messages")[1]["raw_prompt"] == rows[1]["messages"]
    with pytest.raises(DataError, match=r"line 1: field 'prompt'.*data\.prompt_key"):
        RLDataset(path, tok)


def test_string_prompt_is_one_user_message_with_warning(tok, tmp_path):
    listed = [make_row(i) for i in range(3)]
    plain = copy.deepcopy(listed)
    for r in plain:
        r["prompt"] = r["prompt"][0]["content"]
    with pytest.warns(UserWarning, match=r"3 row\(s\).*plain string"):
        ds = RLDataset(write_jsonl(tmp_path / "s.jsonl", plain), tok)
    ref = RLDataset(write_jsonl(tmp_path / "l.jsonl", listed), tok)
    assert [ds[i]["prompt_ids"] for i in range(3)] == [ref[i]["prompt_ids"] for i in range(3)]
    assert ds[0]["raw_prompt"] == listed[0]["prompt"]


def test_tokenizer_without_chat_template(tok, tmp_path):
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    bare.name_or_path = "/models/base-model"
    path = write_jsonl(tmp_path / "a.jsonl", [make_row(0)])
    with pytest.raises(DataError, match=r"/models/base-model.*no chat template.*custom_chat_template"):
        RLDataset(path, bare)


def test_apply_chat_template_kwargs_reach_the_template(tok, tmp_path):
    t = copy.deepcopy(tok)
    t.chat_template = tok.chat_template + "{% if enable_thinking is defined and not enable_thinking %}NT{% endif %}"
    path = write_jsonl(tmp_path / "a.jsonl", [make_row(0)])
    plain = RLDataset(path, t)[0]["prompt_ids"]
    no_think = RLDataset(path, t, apply_chat_template_kwargs={"enable_thinking": False})[0]["prompt_ids"]
    assert no_think == plain + t.encode("NT", add_special_tokens=False)


def _mixed_length_file(tmp_path):
    # prompt i has 10*i extra characters; template adds <|user|>, <|end|>, <|assistant|> (3 tokens)
    rows = [make_row(i, content="q" + "x" * (10 * i)) for i in range(6)]
    return write_jsonl(tmp_path / "len.jsonl", rows), rows


def test_filter_overlong_prompts_counts_and_keeps_index(tok, tmp_path):
    path, rows = _mixed_length_file(tmp_path)
    lengths = [len(expected_ids(tok, r["prompt"])) for r in rows]
    limit = lengths[3]
    ds = RLDataset(path, tok, max_prompt_length=limit, filter_overlong_prompts=True)
    assert len(ds) == 4 and ds.num_filtered == 2
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 1, 2, 3]
    assert all(len(ds[i]["prompt_ids"]) <= limit for i in range(len(ds)))


def test_overlong_prompt_error_names_row_length_limit_and_fixes(tok, tmp_path):
    path, rows = _mixed_length_file(tmp_path)
    length = len(expected_ids(tok, rows[4]["prompt"]))
    limit = len(expected_ids(tok, rows[3]["prompt"]))
    with pytest.raises(DataError) as err:
        RLDataset(path, tok, max_prompt_length=limit)
    msg = str(err.value)
    assert "len.jsonl line 5" in msg and f"{length} tokens" in msg
    assert f"data.max_prompt_length={limit}" in msg and "data.filter_overlong_prompts=True" in msg


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tok, tmp_path, mode):
    path, rows = _mixed_length_file(tmp_path)
    limit = 15
    ds = RLDataset(path, tok, max_prompt_length=limit, truncation=mode)
    assert len(ds) == 6 and ds.num_filtered == 0
    full = expected_ids(tok, rows[5]["prompt"])
    got = ds[5]["prompt_ids"]
    assert len(got) == limit
    if mode == "left":
        assert got == full[-limit:] and got[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    elif mode == "right":
        assert got == full[:limit] and got[0] == tok.convert_tokens_to_ids("<|user|>")
    else:
        assert got == full[:7] + full[-8:]
    assert ds[0]["prompt_ids"] == expected_ids(tok, rows[0]["prompt"])  # short prompt untouched


def test_truncate_ids_middle_keeps_both_ends():
    ids = list(range(10))
    assert truncate_ids(ids, 5, "middle") == [0, 1, 7, 8, 9]
    assert truncate_ids(ids, 1, "middle") == [9]
    assert truncate_ids(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate_ids(ids, 4, "right") == [0, 1, 2, 3]
    assert truncate_ids(ids, 12, "middle") == ids


def test_bad_truncation_mode(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [make_row(0)])
    with pytest.raises(DataError, match="data.truncation='both'"):
        RLDataset(path, tok, truncation="both")


def test_builtin_arithmetic_dataset(tok):
    train = RLDataset("builtin:arithmetic", tok, max_prompt_length=16)
    val = RLDataset("builtin:arithmetic", tok, max_prompt_length=16, split="val")
    assert len(train) == 4096 and len(val) == 256
    item = val[0]
    assert item["data_source"] == "lathe/arithmetic"
    assert tok.decode(item["prompt_ids"]) == "<|user|>" + item["raw_prompt"][0]["content"] + "<|end|><|assistant|>"
    assert str(eval(item["raw_prompt"][0]["content"][:-1])) == item["ground_truth"]
    with pytest.raises(DataError, match="unknown builtin"):
        RLDataset("builtin:nope", tok)


def test_max_samples_keeps_verls_subset(tok, tmp_path):
    """verl's data.train_max_samples / val_max_samples: the first rows, or with shuffle a seeded subset drawn
    without replacement (numpy's default_rng(seed).choice, as verl draws it); <= 0 or more than the file: all."""
    import numpy as np
    path = tmp_path / "d.parquet"
    write_parquet(path, [make_row(i) for i in range(10)])
    first = RLDataset(str(path), tok, max_samples=3)
    assert [first[i]["index"] for i in range(len(first))] == [0, 1, 2]
    drawn = RLDataset(str(path), tok, max_samples=4, shuffle=True, seed=7)
    expected = np.random.default_rng(7).choice(10, size=4, replace=False).tolist()
    assert [drawn[i]["index"] for i in range(len(drawn))] == expected
    assert len(RLDataset(str(path), tok, max_samples=-1)) == len(RLDataset(str(path), tok, max_samples=50)) == 10


@pytest.mark.parametrize("change, match", [
    (_drop("prompt"), r"field 'prompt': missing \(the file's columns \['ability', 'data_source', 'extra_info', "
                      r"'reward_model'\]\). Fix: .*set data.prompt_key"),
    (_drop("data_source"), r"field 'data_source': missing .*Fix: add \"data_source\""),
    (_drop("reward_model"), r"field 'reward_model': missing .*Fix: add \"reward_model\""),
    (lambda r: r.update(reward_model={"style": "rule"}),
     r"field 'reward_model.ground_truth': missing \(reward_model has \['style'\]\)"),
])
def test_check_columns_names_the_file_the_key_the_columns_and_the_fix(tmp_path, change, match):
    """What the row checks say of every row, said once from the parquet schema before any row is read."""
    from lathe.data.dataset import check_columns
    from lathe.data.files import peek
    row = make_row(0)
    change(row)
    path = write_parquet(tmp_path / "d.parquet", [row])
    with pytest.raises(DataError, match=rf"{path} \(data.train_files\): {match}"):
        check_columns(peek(path), "prompt", "data.train_files")
    check_columns(peek(write_parquet(tmp_path / "ok.parquet", [make_row(0)])), "prompt", "data.train_files")


def test_rendered_prompts_are_kept_for_the_same_tokenizer_and_template(tok, tmp_path, monkeypatch):
    """A second dataset over the same rows takes their ids from the process's memo (no chat template run) and gets
    what rendering gives; another template, other template kwargs, another vocabulary or new rows render again; a
    dataset under RENDER_MEMO_MIN_ROWS text rows is not memoised."""
    from lathe.data import dataset
    monkeypatch.setattr(dataset, "_RENDERED", {})
    monkeypatch.setattr(dataset, "RENDER_MEMO_MIN_ROWS", 1)
    rendered = []
    render = RLDataset._render
    monkeypatch.setattr(RLDataset, "_render", lambda self, m, o: rendered.append(o) or render(self, m, o))
    rows = [make_row(i) for i in range(4)]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    first = [RLDataset(path, tok)[i]["prompt_ids"] for i in range(4)]
    assert len(rendered) == 4
    again = RLDataset(write_jsonl(tmp_path / "b.jsonl", rows + [make_row(9)]), tok)
    assert len(rendered) == 5 and [again[i]["prompt_ids"] for i in range(4)] == first
    assert [again[i]["prompt_ids"] for i in range(5)] == [expected_ids(tok, r["prompt"]) for r in rows + [make_row(9)]]
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template + "!"
    assert RLDataset(path, other)[0]["prompt_ids"] == expected_ids(other, rows[0]["prompt"]) != first[0]
    RLDataset(path, tok, apply_chat_template_kwargs={"enable_thinking": False})
    assert len(rendered) == 13
    from lathe.data.dataset import _tokenizer_key
    swapped = copy.deepcopy(tok)            # the same size, two tokens' ids exchanged: another key
    vocab = swapped.get_vocab()
    a, b = sorted(vocab)[:2]
    monkeypatch.setattr(swapped, "get_vocab", lambda: {**vocab, a: vocab[b], b: vocab[a]})
    assert _tokenizer_key(swapped) != _tokenizer_key(tok) == _tokenizer_key(copy.deepcopy(tok))
    monkeypatch.setattr(dataset, "RENDER_MEMO_MIN_ROWS", 5)      # fewer rows: rendered every time, never kept
    before = len(rendered)
    RLDataset(path, tok), RLDataset(path, tok)
    assert len(rendered) == before + 8


def test_reward_fn_key_keeps_that_column_as_each_item_s_reward_source(tok, tmp_path):
    """data.reward_fn_key=ability: the item carries the row's ability (what its reward function gets as
    data_source) beside its data_source."""
    from lathe.data.dataset import reward_source
    rows = [dict(make_row(i), ability=f"skill/{i % 2}") for i in range(4)]
    ds = RLDataset(write_parquet(tmp_path / "a.parquet", rows), tok, reward_fn_key="ability")
    assert [ds[i]["reward_source"] for i in range(4)] == ["skill/0", "skill/1", "skill/0", "skill/1"]
    assert [reward_source(ds[i]) for i in range(4)] == ["skill/0", "skill/1", "skill/0", "skill/1"]
    assert all(ds[i]["data_source"] == "openai/gsm8k" for i in range(4))
    plain = RLDataset(write_parquet(tmp_path / "b.parquet", rows), tok)
    assert "reward_source" not in plain[0] and reward_source(plain[0]) == "openai/gsm8k"


@pytest.mark.parametrize("value, problem", [(_drop("ability"), r"missing \(row has keys \['data_source', "
                                                                 r"'extra_info', 'prompt', 'reward_model'\]\)"),
                                            (lambda r: r.update(ability=None), "null")])
def test_a_missing_reward_fn_key_column_names_the_key_the_column_and_the_columns(tok, tmp_path, value, problem):
    rows = [make_row(0), make_row(1)]
    value(rows[1])
    with pytest.raises(DataError, match=rf"line 2: field 'ability': {problem}. Fix: data.reward_fn_key='ability' "
                                        r"names the column whose value the reward function gets as data_source"):
        RLDataset(write_jsonl(tmp_path / "a.jsonl", rows), tok, reward_fn_key="ability")


def test_check_columns_asks_for_the_reward_fn_key_column(tmp_path):
    from lathe.data.dataset import check_columns
    from lathe.data.files import peek
    path = write_parquet(tmp_path / "d.parquet", [make_row(0)])
    with pytest.raises(DataError, match=r"field 'task': missing \(the file's columns \['ability', 'data_source', "
                                        r"'extra_info', 'prompt', 'reward_model'\]\). Fix: data.reward_fn_key='task'"):
        check_columns(peek(path), "prompt", "data.train_files", reward_fn_key="task")
    check_columns(peek(path), "prompt", "data.train_files", reward_fn_key="ability")


def test_an_agent_name_column_names_each_rows_agent_loop(tok, tmp_path):
    """verl's `agent_name` column (the custom agent loop of a row; null: the default loop) reaches the prompt batch;
    a value that is not a name is refused naming the row."""
    from lathe.loop.setup import prompt_batch
    rows = [dict(make_row(i), agent_name=[None, "math_agent"][i % 2]) for i in range(4)]
    ds = RLDataset(write_jsonl(tmp_path / "a.jsonl", rows), tok)
    assert [ds[i].get("agent_name") for i in range(4)] == [None, "math_agent", None, "math_agent"]
    assert list(prompt_batch([ds[i] for i in range(4)], step=1)["agent_name"]) == [None, "math_agent"] * 2
    assert "agent_name" not in prompt_batch([ds[0], ds[2]], step=1)
    rows[2]["agent_name"] = 3
    with pytest.raises(DataError, match=r"line 3: field 'agent_name': expected a loop's name, got 3"):
        RLDataset(write_jsonl(tmp_path / "b.jsonl", rows), tok)


def test_video_rows_are_refused_naming_the_row_and_column(tok, tmp_path):
    """verl's video schema (a `videos` column, `<video>` placeholders) is not implemented: a row with videos fails
    at load, naming its file, row and column (it was read as text before, its videos dropped); an empty or null
    column loads as text, and `video_key` names the column."""
    rows = [{**make_row(i), "videos": []} for i in range(3)]
    rows[2]["videos"] = [{"video": "clip.mp4", "fps": 2.0}]
    rows[2]["prompt"] = [{"role": "user", "content": "<video>What happens?"}]
    path = write_parquet(tmp_path / "v.parquet", rows)
    with pytest.raises(DataError, match=r"v\.parquet row 2: field 'videos': the row has videos.*image frames"):
        RLDataset(path, tok)
    assert len(RLDataset(write_parquet(tmp_path / "ok.parquet", rows[:2]), tok)) == 2
    with pytest.raises(DataError, match="field 'clips'"):
        RLDataset(write_parquet(tmp_path / "c.parquet", [{**make_row(0), "clips": ["a.mp4"]}]), tok,
                  video_key="clips")
