"""The PPO epoch loop (`lathe.train.update`): verl's `shuffle` of the rows between epochs."""

import numpy as np
import torch

from lathe.batch import GHOST, Batch
from lathe.train.update import EpochShuffle, run_ppo_epochs


def _rows(n: int, uids=None) -> Batch:
    batch = Batch({"row": torch.arange(n)})
    if uids is not None:
        batch["uid"] = np.array(uids, dtype=object)
    return batch


def test_each_epoch_draws_a_permutation_from_seed_update_and_epoch():
    batch = _rows(32)
    orders = {(s, u, e): EpochShuffle(s, u).order(batch, e) for s in (1, 2) for u in (0, 1) for e in (0, 1)}
    assert all(sorted(o) == list(range(32)) for o in orders.values())
    assert len({tuple(o) for o in orders.values()}) == len(orders)          # each key its own order
    assert EpochShuffle(1, 0).order(batch, 1) == orders[1, 0, 1]             # a resumed run draws the same
    assert EpochShuffle(-3, 0).order(batch, 0) != list(range(32))           # any int seeds


def test_by_prompt_moves_each_prompts_rows_together_and_a_ghost_alone():
    uids = ["a", "a", "b", "b", "c", "c", "b", "a"]     # a prompt's rows need not be adjacent to start with
    batch = _rows(8, uids)
    batch[GHOST] = torch.tensor([False] * 6 + [True, False])        # row 6 is a ghost copy of a "b" row
    for update in range(20):
        order = EpochShuffle(7, update, by_prompt=True).order(batch, 0)
        assert sorted(order) == list(range(8))
        units = [("ghost", i) if i == 6 else uids[i] for i in order]
        runs = [u for k, u in enumerate(units) if k == 0 or u != units[k - 1]]
        assert len(runs) == len(set(runs)) == 4          # a, b, c and the ghost: each one run
        for u in "abc":                                  # a prompt's rows keep their order
            rows = [i for i in order if i != 6 and uids[i] == u]
            assert rows == sorted(rows)
    assert EpochShuffle(7, 0, by_prompt=True).order(_rows(9), 0) == EpochShuffle(7, 0).order(_rows(9), 0)  # no uid


def test_shuffled_epochs_cut_each_epochs_order_into_mini_batches():
    batch, seen = _rows(12), []

    def record(mini):
        seen.append(mini["row"].tolist())
        return {"n": float(len(mini))}

    shuffle = EpochShuffle(5, 3)
    out = run_ppo_epochs(batch, epochs=2, mini_batch_size=4, update_mini_batch=record, shuffle=shuffle)
    assert out == {"n": 4.0} and len(seen) == 6
    for epoch in range(2):
        order = shuffle.order(batch, epoch)
        assert seen[3 * epoch:3 * epoch + 3] == [order[0:4], order[4:8], order[8:12]]
    assert seen[0:3] != seen[3:6]
    seen.clear()
    run_ppo_epochs(batch, epochs=2, mini_batch_size=12, update_mini_batch=record, shuffle=shuffle)
    assert seen == [list(range(12))] * 2             # one mini-batch: nothing to shuffle between
    seen.clear()
    run_ppo_epochs(batch, epochs=1, mini_batch_size=4, update_mini_batch=record)
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_checkpoint_resumes_only_into_the_optimizer_that_wrote_it(tmp_path, make_model):
    """`optimizer_class` in optim.pt: lathe's forms of AdamW are one; another class is refused naming both and the
    fix (torch would take AdamW's param groups as SGD's and fail at its first step); a checkpoint from before the
    field holds AdamW's state."""
    import pytest

    from lathe.train.master_weights import master_optimizer
    from lathe.train.offloaded_adamw import OffloadedAdamW
    from lathe.train.precision import PrecisionPolicy
    from lathe.train.optim import check_optimizer_class, optimizer_name
    from lathe.train.update import load_policy_checkpoint, save_trainable
    one = [torch.nn.Parameter(torch.ones(2))]
    mixed = PrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, master_dtype=torch.float32)
    assert optimizer_name(OffloadedAdamW(one)) == optimizer_name(torch.optim.AdamW(one)) == "torch.optim.AdamW"
    assert optimizer_name(master_optimizer(torch.optim.SGD, [torch.nn.Parameter(torch.ones(2))], policy=mixed,
                                           lr=0.1)) == "torch.optim.SGD"
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save_trainable(tmp_path / "ckpt", model, sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0))
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="holds the state of torch.optim.SGD, but this run's actor optimizer is "
                                         "torch.optim.AdamW. Fix: resume with the actor's optim.optimizer=SGD"):
        load_policy_checkpoint(tmp_path / "ckpt", model, adamw,
                               torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1.0), what="actor")
    check_optimizer_class({}, adamw, tmp_path, "actor")
    with pytest.raises(ValueError, match="holds the state of torch.optim.AdamW"):
        check_optimizer_class({}, sgd, tmp_path, "critic")
