"""Tests for lathe.rollout.base: the `to_batch` tensor layout and `concat_rollouts`."""

import pytest
import torch

from lathe.generation import RolloutOutput
from lathe.rollout.base import position_ids_from_mask, to_batch

PAD = 0


def _example():
    prompts = [[11, 12, 13], [21]]
    out = RolloutOutput(
        token_ids=[[31, 32], [33], [41, 42, 43, 44], [45, 46]],
        logprobs=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6, -0.7], [-0.8, -0.9]],
        finish_reasons=["stop", "stop", "length", "stop"],
    )
    return prompts, out


def test_to_batch_left_pads_prompts_and_right_pads_responses():
    prompts, out = _example()
    b = to_batch(prompts, out, PAD, n=2)
    assert len(b) == 4
    assert b["prompts"].tolist() == [[11, 12, 13], [11, 12, 13], [PAD, PAD, 21], [PAD, PAD, 21]]
    assert b["responses"].tolist() == [[31, 32, PAD, PAD], [33, PAD, PAD, PAD], [41, 42, 43, 44], [45, 46, PAD, PAD]]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert list(b["finish_reason"]) == out.finish_reasons


def test_to_batch_masks_and_positions():
    prompts, out = _example()
    b = to_batch(prompts, out, PAD, n=2)
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]]
    # Positions count real tokens from 0 at the first real token, whatever the left padding.
    for row in range(4):
        mask = b["attention_mask"][row].bool()
        assert b["position_ids"][row][mask].tolist() == list(range(int(mask.sum())))
    assert b["position_ids"][2, :2].tolist() == [0, 0]


def test_to_batch_log_probs_zero_on_padding():
    prompts, out = _example()
    b = to_batch(prompts, out, PAD, n=2)
    lp = b["rollout_log_probs"]
    assert lp.dtype == torch.float32
    assert torch.allclose(lp[2], torch.tensor([-0.4, -0.5, -0.6, -0.7]))
    assert torch.allclose(lp[1], torch.tensor([-0.3, 0.0, 0.0, 0.0]))
    assert torch.all(lp[b["response_mask"] == 0] == 0)


def test_to_batch_empty_responses_keep_one_column():
    out = RolloutOutput(token_ids=[[], []], logprobs=[[], []], finish_reasons=["length", "length"])
    b = to_batch([[5, 6], [7]], out, PAD, n=1)
    assert b["responses"].shape == (2, 1)
    assert b["response_mask"].sum() == 0
    assert b["input_ids"].shape == (2, 3)


def test_to_batch_rejects_sample_count_mismatch():
    prompts, out = _example()
    with pytest.raises(ValueError, match="4 samples for 6"):
        to_batch(prompts, out, PAD, n=3)


def test_to_batch_rejects_per_token_values_that_do_not_line_up():
    prompts, out = _example()
    out.logprobs[2] = out.logprobs[2][:-1]
    with pytest.raises(ValueError, match="logprobs of sample 2"):
        to_batch(prompts, out, PAD, n=2)
    prompts, out = _example()
    out.logprobs.pop()
    with pytest.raises(ValueError, match="logprobs of sample 3 .*3 samples of logprobs for 4"):
        to_batch(prompts, out, PAD, n=2)


def test_to_batch_loss_masks_from_the_agent_loop():
    prompts, out = _example()
    out.loss_masks = [[1, 0], [1], [1, 0, 0, 1], [0, 1]]
    b = to_batch(prompts, out, PAD, n=2)
    assert b["response_mask"].tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 1], [0, 1, 0, 0]]
    assert b["attention_mask"][:, 3:].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_concat_rollouts_repads_batches_of_different_widths():
    from lathe.rollout.base import concat_rollouts
    a = to_batch([[5, 6]], RolloutOutput([[7]], [[-0.5]], ["stop"]), pad_id=0, n=1)
    b = to_batch([[1, 2, 3]], RolloutOutput([[8, 9, 4]], [[-1.0, -2.0, -3.0]], ["length"]), pad_id=0, n=1)
    a["token_level_scores"] = torch.tensor([[1.0]])
    b["token_level_scores"] = torch.tensor([[0.0, 0.0, 0.5]])
    joined = concat_rollouts([a, b], pad_id=0)
    assert joined["prompts"].tolist() == [[0, 5, 6], [1, 2, 3]]
    assert joined["responses"].tolist() == [[7, 0, 0], [8, 9, 4]]
    assert joined["input_ids"].tolist() == [[0, 5, 6, 7, 0, 0], [1, 2, 3, 8, 9, 4]]
    assert joined["attention_mask"].tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert joined["position_ids"][0].tolist()[:4] == [0, 0, 1, 2]
    assert joined["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert joined["token_level_scores"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.5]]
    # each row equals its own batch re-laid out: the rebuilt full sequence matches prompts + responses
    assert torch.equal(joined["input_ids"], torch.cat([joined["prompts"], joined["responses"]], dim=1))
