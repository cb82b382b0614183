"""DAPO's dynamic sampling in fully-async mode (`lathe.loop.fully_async_dapo`), both pools in this process
(tests/loop/test_async_inprocess.py): on-policy it is the synchronous loop's dynamic sampling, round for round."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lathe.batch import Batch
from lathe.cli import main
from lathe.loop.fully_async_dapo import DynamicSampling
from lathe.loop.sampling import DynamicSamplingExhausted
from loop.test_async_inprocess import FAST, ON_POLICY, assert_same_steps, in_process_pools, train  # noqa: F401

DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.gen_batch_size=4"]


def test_on_policy_dynamic_sampling_is_the_synchronous_loops(tmp_path, in_process_pools):
    sync = train(tmp_path / "sync", *DAPO)
    on_policy = train(tmp_path / "async", *DAPO, *ON_POLICY)
    assert_same_steps(sync, on_policy, keys=("actor/pg_loss", "actor/grad_norm", "critic/score/mean",
                                             "response_length/mean", "train/num_gen_batches"))


def _round(first: int, accs: list[list[float]], n: int = 2) -> Batch:
    """A finished request of len(accs) prompts (issue indices first...), each group's n `acc` values."""
    rows = [(f"p{first + g}", a) for g, group in enumerate(accs) for a in group]
    k = len(rows)
    batch = Batch({"acc": torch.tensor([float(a) for _, a in rows]), "prompts": torch.ones(k, 1).long(),
                   "responses": torch.ones(k, 1).long(), "attention_mask": torch.ones(k, 2).long()},
                  {"uid": [u for u, _ in rows]})
    batch.meta.update(first=first, indices=list(range(first, first + len(accs))))
    return batch


def test_rounds_go_to_the_oldest_short_step_and_a_filled_step_discards_what_is_left():
    fg = SimpleNamespace(metric="acc", max_num_gen_batches=3)
    ds = DynamicSampling(fg, step_prompts=2, n=2, first_step=1)
    for first in (0, 2, 4):                                    # ahead of the trainer: steps 1, 2 and 3
        label = ds.label()
        ds.issued(first, label, 2)
    assert [ds.label_of[f] for f in (0, 2, 4)] == [(1, 0), (2, 0), (3, 0)]
    assert ds.arrived(2, _round(2, [[1, 0], [0, 1]])) == []     # step 2 full, but step 1 goes first
    assert not ds.ready()
    assert ds.arrived(0, _round(0, [[1, 1], [0, 1]])) == [0]    # step 1 loses a group: it gets the next round
    assert ds.label() == (1, 2) and not ds.ready()
    ds.issued(6, (1, 2), 2)
    assert ds.arrived(6, _round(6, [[0, 1], [1, 0]])) == []
    assert ds.ready() and ds.queued_prompts() == 5
    batch, never, metrics = ds.take(pad_id=0)
    assert batch.meta["indices"] == [1, 6] and never == [7] and len(batch) == 4
    assert metrics == {"train/num_gen_batches": 2, "fully_async/dapo/dropped_groups": 1,
                       "fully_async/dapo/discarded_groups": 1}
    assert ds.ready() and ds.pending() == {2, 3}                # step 2 was full all along
    ds.take(pad_id=0)
    assert ds.arrived(4, _round(4, [[1, 1], [0, 0]])) == [4, 5] and ds.label() == (3, 2)
    ds.issued(10, (3, 2), 2)
    assert ds.arrived(10, _round(10, [[1, 1], [1, 1]])) == [10, 11]
    ds.issued(12, ds.label(), 2)
    assert ds.label_of[12] == (3, 3)
    ds.arrived(12, _round(12, [[1, 1], [1, 1]]))
    with pytest.raises(DynamicSamplingExhausted, match="after 3 generation rounds .* for step 3"):
        ds.label()


def test_async_dynamic_sampling_gives_up_with_the_synchronous_loops_message(tmp_path, in_process_pools, capsys):
    # no warm start: every sample scores 0, so no group ever has variance
    rc = main(["train", *FAST, f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.warm_start.steps=0",
               *DAPO, *ON_POLICY, "algorithm.filter_groups.max_num_gen_batches=2"])
    assert rc == 2
    assert "after 2 generation rounds (max_num_gen_batches=2) for step 1" in capsys.readouterr().err


def test_a_round_larger_than_a_step_is_refused_naming_dynamic_sampling():
    from lathe.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="gen_batch_size=48 .* must divide .* a request is one generation round"):
        load_config("default", [*DAPO, *ON_POLICY, "data.gen_batch_size=48"])
