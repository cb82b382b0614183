"""verl's `data.custom_cls`: a user's dataset class, built with verl's arguments, whose items become lathe's rows."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from config.verl_corpus import problems
from lathe.config import ConfigError, load_config
from lathe.data import DataError, builtin_tokenizer
from lathe.data.custom import ConfigView, custom_rows, load_dataset_class
from lathe.loop.setup import load_datasets

# A class in the shape verl's recipes write: it reads files of its own schema ("a,b" sums) and returns verl's items,
# token ids of its own included (lathe renders the messages itself, so they are not read).
SUMS = textwrap.dedent('''
    import torch
    from torch.utils.data import Dataset

    class SumsDataset(Dataset):
        built_with = None

        def __init__(self, data_files, tokenizer, config, processor=None, max_samples=-1):
            SumsDataset.built_with = dict(files=list(data_files), tokenizer=tokenizer, processor=processor,
                                          max_prompt_length=config.max_prompt_length,
                                          prompt_key=config.get("prompt_key"), max_samples=max_samples)
            self.pairs = [tuple(int(x) for x in line.split(","))
                          for path in data_files for line in open(path).read().split()]

        def __len__(self):
            return len(self.pairs)

        def __getitem__(self, i):
            a, b = self.pairs[i]
            item = {"raw_prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "lathe/arithmetic",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {"index": i},
                    "input_ids": torch.tensor([1, 2, 3]), "index": i}
            if a == 99:                     # a broken item, to see the error name it
                del item["data_source"]
            return item

    class NoMaxSamples(SumsDataset):
        def __init__(self, data_files, tokenizer, processor, config):
            super().__init__(data_files, tokenizer, config, processor)
''')


def write(tmp_path: Path, pairs=((1, 2), (3, 4), (5, 6), (7, 8))) -> tuple[Path, Path]:
    (tmp_path / "sums.py").write_text(SUMS)
    data = tmp_path / "sums.txt"
    data.write_text("\n".join(f"{a},{b}" for a, b in pairs))
    return tmp_path / "sums.py", data


def config(cls: Path, data: Path, name: str = "SumsDataset", *extra: str):
    return load_config(None, [f"data.custom_cls.path={cls}", f"data.custom_cls.name={name}",
                              f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1", *extra])


def test_the_items_become_rows_rendered_by_lathe(tmp_path):
    cls, data = write(tmp_path)
    tokenizer = builtin_tokenizer()
    train, val = load_datasets(config(cls, data), tokenizer)
    module = load_dataset_class(str(cls), "SumsDataset")
    assert val is None and len(train) == 4
    row = train[1]
    assert row["raw_prompt"] == [{"role": "user", "content": "3+4="}] and row["ground_truth"] == "7"
    assert row["data_source"] == "lathe/arithmetic" and row["extra_info"] == {"index": 1}
    rendered = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert row["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]   # not the class's ids
    assert module.built_with["files"] == [str(data)] and module.built_with["tokenizer"] is tokenizer
    assert module.built_with["processor"] is None and module.built_with["prompt_key"] == "prompt"


def test_max_samples_is_kept_by_the_class_or_by_lathe(tmp_path):
    cls, data = write(tmp_path)
    train, _ = load_datasets(config(cls, data, "SumsDataset", "data.train_max_samples=3"), builtin_tokenizer())
    assert load_dataset_class(str(cls), "SumsDataset").built_with["max_samples"] == 3 and len(train) == 3
    train, _ = load_datasets(config(cls, data, "NoMaxSamples", "data.train_max_samples=2"), builtin_tokenizer())
    assert len(train) == 2                     # the class does not take max_samples: lathe keeps 2 of its items


@pytest.mark.parametrize("name, pairs, message", [
    ("SumDataset", None, r"has no class 'SumDataset' .* Did you mean 'SumsDataset'\?"),
    ("textwrap", None, "not a class"),
    ("SumsDataset", ((1, 2), (99, 1)), r"\(.*sums.py\) item 1: field 'data_source': expected a non-empty string"),
])
def test_what_is_wrong_is_named(tmp_path, name, pairs, message):
    cls, data = write(tmp_path, *([pairs] if pairs else []))
    (tmp_path / "sums.py").write_text(SUMS + "import textwrap\n")
    with pytest.raises(DataError, match=message):
        load_datasets(config(cls, data, name), builtin_tokenizer())


def test_a_missing_file_or_a_verl_import_is_named_with_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"data.custom_cls.path='nowhere.py': no such file"):
        load_dataset_class("nowhere.py", "X")
    verl_style = tmp_path / "recipe.py"
    verl_style.write_text("from verl.utils.dataset import RLHFDataset\n\nclass Mine(RLHFDataset):\n    pass\n")
    with pytest.raises(DataError, match=r"No module named 'verl'.*make the class standalone"):
        load_dataset_class(str(verl_style), "Mine")
    not_a_dataset = tmp_path / "plain.py"
    not_a_dataset.write_text("class Rows:\n    def __init__(self, **kw):\n        pass\n")
    with pytest.raises(DataError, match="no __len__ or __getitem__"):
        load_dataset_class(str(not_a_dataset), "Rows")


def test_a_constructor_verl_cannot_call_is_named(tmp_path):
    (tmp_path / "odd.py").write_text("class Odd:\n    def __init__(self, paths):\n        pass\n"
                                     "    def __len__(self):\n        return 0\n"
                                     "    def __getitem__(self, i):\n        return {}\n")
    with pytest.raises(DataError, match=r"cannot be built as verl builds it.*Fix: give its __init__"):
        load_datasets(config(tmp_path / "odd.py", tmp_path / "x.txt", "Odd"), builtin_tokenizer())


def test_items_without_messages_or_not_dicts_are_named():
    class Items:
        def __init__(self, items):
            self.items = items

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    with pytest.raises(DataError, match=r"src item 0: field 'raw_prompt': missing \(the item has keys "
                                        r"\['data_source', 'input_ids'\]\)"):
        list(custom_rows(Items([{"data_source": "x", "input_ids": [1]}]), "src", "prompt", "images"))
    with pytest.raises(DataError, match="src item 0: expected a dict"):
        list(custom_rows(Items([["a"]]), "src", "prompt", "images"))
    with pytest.raises(DataError, match=r"item 0: field 'raw_prompt\[0\].content': a content part of type 'video'"):
        list(custom_rows(Items([{"raw_prompt": [{"role": "user", "content": [{"type": "video"}]}]}]), "src",
                         "prompt", "images"))


def test_verl_content_lists_become_placeholders_and_images():
    image = object()
    item = {"raw_prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                        {"type": "text", "text": "Find x."}]}],
            "data_source": "geo3k", "prompt": "the unread column"}
    (where, row), = custom_rows([item], "src", "prompt", "images")
    assert where == "item 0" and row["prompt"] == [{"role": "user", "content": "<image>Find x."}]
    assert row["images"] == [image] and "raw_prompt" not in row
    old_style = {"prompt": [{"role": "user", "content": "<image>x"}], "multi_modal_data": {"image": [image]}}
    (_, row), = custom_rows([old_style], "src", "prompt", "images")
    assert row["images"] == [image] and "multi_modal_data" not in row


def test_the_config_reads_as_verl_passes_it():
    view = ConfigView.of(load_config(None, []).data)
    assert view.max_prompt_length == view["max_prompt_length"] == view.get("max_prompt_length")
    assert view.custom_cls.path is None and view.get("no_such_key", 7) == 7
    with pytest.raises(AttributeError, match="no key 'no_such_key'"):
        view.no_such_key


def test_path_and_name_go_together():
    with pytest.raises(ConfigError, match=r"data.custom_cls.path=x.py is set but data.custom_cls.name is not"):
        load_config(None, ["data.custom_cls.path=x.py"])


def test_verl_minicpm_script_loads():
    assert problems("grpo_trainer_run_minicpm_o_2_6_fsdp") == []


def test_a_training_step_runs_on_the_class_rows(tmp_path):
    """`lathe train`'s trainer on the class's rows: preflight imports the class, the loop trains a step on them."""
    from helpers import warm_started
    from lathe.loop.ppo import fit
    from lathe.loop.preflight import preflight
    from lathe.loop.setup import build_trainer
    cls, data = write(tmp_path)
    cfg = config(cls, data, "SumsDataset", *warm_started(100), "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_response_length=4",
                 "trainer.logger=[console]", "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'run'}")
    trainer = build_trainer(cfg, preflight(cfg))
    try:
        metrics = fit(trainer)
    finally:
        trainer.close()
    assert trainer.global_step == 1 and "actor/pg_loss" in metrics and metrics["critic/score/mean"] >= 0
