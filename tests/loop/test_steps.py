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
