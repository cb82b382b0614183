"""lathe.loop.steps: GDPO's reward components from the reward function's dict results."""

import pytest
import torch

from lathe.batch import Batch
from lathe.loop.steps import reward_components


def _batch(extras, scores=None):
    scores = scores if scores is not None else [0.0] * len(extras)
    return Batch({"seq_scores": torch.tensor(scores)}, {"reward_extra_info": extras})


def test_components_in_key_order_and_a_failed_scoring_scores_zero():
    extras = [{"acc": 1.0, "fmt": 0.5}, {}, {"fmt": 1.0, "acc": 0.0}]
    comps = reward_components(_batch(extras, [1.5, 0.0, 1.0]), ["fmt", "acc", "score"])
    assert comps.tolist() == [[0.5, 1.0, 1.5], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]


def test_a_missing_key_names_it_and_the_keys_present():
    with pytest.raises(ValueError, match=r"'format_reward'.*keys present: acc, len.*Fix"):
        reward_components(_batch([{"acc": 1.0, "len": 3.0}, {"acc": 0.0, "len": 2.0}]), ["acc", "format_reward"])
    with pytest.raises(ValueError, match="of 1 responses"):
        reward_components(_batch([{"acc": 1.0, "fmt": 1.0}, {"acc": 0.0}]), ["fmt"])
    with pytest.raises(ValueError, match="none: it returned plain numbers"):
        reward_components(_batch([{}, {}]), ["acc"])


def test_the_scorer_gets_the_reward_fn_key_column_as_data_source():
    """data.reward_fn_key: each row's `reward_source` (its column's value, carried from the dataset through
    prompt_batch) is what the reward function gets as data_source; without it, data_source."""
    from lathe.data.builtin import builtin_tokenizer
    from lathe.loop.setup import prompt_batch
    from lathe.loop.steps import compute_reward
    from lathe.reward import ScoreResult

    class Recorder:
        def score(self, items):
            self.sources = [item["data_source"] for item in items]
            return [ScoreResult(1.0) for _ in items]

        def metrics(self):
            return {}

    rows = [{"prompt_ids": [1], "raw_prompt": [], "data_source": "gsm8k", "ground_truth": "1", "extra_info": {},
             "index": i, "reward_source": f"skill/{i}"} for i in range(2)]
    tensors = {"responses": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
               "response_mask": torch.ones(2, 3, dtype=torch.long)}
    tok, rec = builtin_tokenizer(), Recorder()
    compute_reward(prompt_batch(rows, step=1).update(Batch(tensors)), tok, rec)
    assert rec.sources == ["skill/0", "skill/1"]
    plain = prompt_batch([{k: v for k, v in r.items() if k != "reward_source"} for r in rows], step=1)
    assert "reward_source" not in plain
    compute_reward(plain.update(Batch(tensors)), tok, rec)
    assert rec.sources == ["gsm8k", "gsm8k"]


def test_a_custom_loops_scores_stand_and_only_the_other_samples_are_scored():
    """`agent_reward_score` (a custom agent loop's AgentLoopOutput.reward_score, None where it gave none): those
    samples keep their score and skip the reward function; the others are scored; a reward model's scores yield to
    them as well."""
    from lathe.data.builtin import builtin_tokenizer
    from lathe.loop.setup import prompt_batch
    from lathe.loop.steps import compute_reward
    from lathe.reward import ScoreResult
    from lathe.rollout.agent import AGENT_SCORE

    class Recorder:
        def score(self, items):
            self.indices = [item["extra_info"]["i"] for item in items]
            return [ScoreResult(10.0 + item["extra_info"]["i"]) for item in items]

        def metrics(self):
            return {}

    rows = [{"prompt_ids": [1], "raw_prompt": [], "data_source": "d", "ground_truth": "1", "extra_info": {"i": i},
             "index": i} for i in range(3)]
    tensors = {"responses": torch.ones(3, 3, dtype=torch.long), "attention_mask": torch.ones(3, 4, dtype=torch.long),
               "response_mask": torch.ones(3, 3, dtype=torch.long)}
    batch = prompt_batch(rows, step=1).update(Batch(tensors))
    batch[AGENT_SCORE] = [0.5, None, -1.0]
    rec = Recorder()
    out, _ = compute_reward(batch, builtin_tokenizer(), rec)
    assert rec.indices == [1] and out["seq_scores"].tolist() == [0.5, 11.0, -1.0]
    out, _ = compute_reward(batch, builtin_tokenizer(), rec, rm_scores=torch.tensor([3.0, 4.0, 5.0]))
    assert out["seq_scores"].tolist() == [0.5, 4.0, -1.0]
