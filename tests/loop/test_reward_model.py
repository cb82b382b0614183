"""`lathe train` with a learned reward model (`reward_model.enable`): its scores are the step's scores."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForSequenceClassification

from helpers import RM_TEMPLATE, tiny_reward_model
from lathe.config import load_config
from lathe.loop.ppo import fit
from lathe.loop.setup import build_trainer

RUN = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
       "data.max_response_length=4", "actor_rollout_ref.model.warm_start.steps=0", "trainer.total_training_steps=2",
       "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]"]


def rm_overrides(path) -> list[str]:
    return ["reward_model.enable=true", f"reward_model.model.path={path}", "reward_model.micro_batch_size_per_gpu=3",
            "reward_model.max_length=256"]


def test_two_steps_score_with_the_reward_model(tmp_path):
    path = tiny_reward_model(tmp_path / "rm", chat_template=RM_TEMPLATE)
    cfg = load_config(None, [*RUN, *rm_overrides(path), f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = build_trainer(cfg)
    seen = []
    score = trainer.reward_model.compute_rm_score

    def recorded(batch):
        out = score(batch)
        seen.append((batch, out["rm_scores"]))
        return out

    trainer.reward_model.compute_rm_score = recorded
    try:
        fit(trainer)
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(seen) == 2
    for metrics, (_, scores) in zip(rows, seen):
        assert abs(metrics["critic/score/mean"] - scores.mean().item()) < 1e-6
        assert abs(metrics["critic/score/max"] - scores.max().item()) < 1e-6
        assert "reward_extra/acc/mean" not in metrics                 # the rule scorer was not called
    batch, scores = seen[0]                                              # row 0 by transformers, from its text
    rm = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    tok = trainer.reward_model.tokenizer
    n = int(batch["attention_mask"][0, -batch["responses"].shape[1]:].sum())
    response = trainer.tokenizer.decode(batch["responses"][0, :n].tolist()).replace(trainer.tokenizer.eos_token, "")
    text = tok.apply_chat_template(list(batch["raw_prompt"][0]) + [{"role": "assistant", "content": response}],
                                   tokenize=False)
    with torch.no_grad():
        expected = rm(input_ids=torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])).logits[0, 0]
    assert abs(scores[0].item() - expected.item()) < 1e-4
