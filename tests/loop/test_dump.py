"""trainer.rollout_data_dir / validation_data_dir / log_val_generations, and the model keys a run applies
(custom_chat_template, external_lib) and DAPO's data.gen_batch_size, on one short run of the built-in task."""

from __future__ import annotations

import json
import sys

import torch

from lathe.batch import Batch
from lathe.loop.dump import generation_rows, pick_samples
from loop.test_ppo import run

TEMPLATE = "'{% for m in messages %}Q: {{ m.content }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}'"
PARITY_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    odd = float(len(solution_str) % 2)\n"
                 "    return {'score': odd, 'acc': odd, 'length': len(solution_str)}\n")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_dumps_its_samples_and_applies_the_model_keys(tmp_path, monkeypatch):
    (tmp_path / "lathe_test_extlib.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lathe_test_extlib", raising=False)
    (tmp_path / "parity.py").write_text(PARITY_REWARD)   # random responses still give groups reward variance
    rollouts, vals = tmp_path / "rollouts", tmp_path / "vals"
    trainer = run(tmp_path, "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=1",
                  "trainer.test_freq=1", "trainer.val_before_train=false", "trainer.logger=[console,tensorboard]",
                  "reward.timeout_s=0",
                  f"reward.custom_reward_function.path={tmp_path / 'parity.py'}",
                  f"trainer.rollout_data_dir={rollouts}", f"trainer.validation_data_dir={vals}",
                  "trainer.log_val_generations=2", f"actor_rollout_ref.model.custom_chat_template={TEMPLATE}",
                  "actor_rollout_ref.model.external_lib=lathe_test_extlib",
                  "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=20",
                  "data.gen_batch_size=8")
    assert sys.modules["lathe_test_extlib"].IMPORTED
    assert trainer.loader.batch_size == 8                       # each generation round draws gen_batch_size prompts
    rows = read_jsonl(rollouts / "1.jsonl")
    assert len(rows) == 4 * 4                                    # train_batch_size x n kept after filtering
    assert all(r["input"].startswith("Q: ") and r["input"].endswith(" A:") for r in rows)   # the custom template
    assert {"input", "output", "gts", "score", "step", "acc", "length"} <= set(rows[0]) and rows[0]["step"] == 1
    assert all(r["score"] == len(r["output"]) % 2 for r in rows)
    assert sorted(p.name for p in vals.iterdir()) == ["1.jsonl"]
    val_rows = read_jsonl(vals / "1.jsonl")
    assert len(val_rows) == len(trainer.val_dataset) and val_rows[0]["reward"] == val_rows[0]["score"]
    assert _tensorboard_texts(tmp_path / "run" / "tensorboard") == {1: 2}


def _tensorboard_texts(log_dir) -> dict[int, int]:
    """step -> samples in the val/generations text entries of a tensorboard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode().count("### Sample")
            for e in acc.Tensors("val/generations/text_summary")}


def test_pick_samples_is_verls_choice():
    samples = [(f"q{i}", f"a{i}", float(i)) for i in range(10)]
    picked = pick_samples(list(reversed(samples)), 3)
    assert picked == pick_samples(samples, 3) and len(set(picked)) == 3     # order of arrival does not matter
    assert pick_samples(samples, 20) == pick_samples(samples, 10) and len(pick_samples(samples, 20)) == 10


def test_generation_rows_keep_extras_every_sample_has():
    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    batch = Batch({"token_level_scores": torch.tensor([[0.0, 1.0], [0.0, -0.5]])},
                  {"prompt_ids": [tok.encode("1+1="), tok.encode("2+2=")], "response_text": ["2", "5"],
                   "ground_truth": ["2", "4"], "reward_extra_info": [{"acc": 1.0, "x": 1}, {"acc": 0.0}]})
    assert generation_rows(batch, tok, step=7) == [
        {"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "step": 7, "acc": 1.0},
        {"input": "2+2=", "output": "5", "gts": "4", "score": -0.5, "step": 7, "acc": 0.0}]
