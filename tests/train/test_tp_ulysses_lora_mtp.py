"""Three-way compositions on the training mesh: LoRA and MTP training each beside tensor parallelism x Ulysses (TP 2 x
SP 2 on 4 gloo ranks: one block, the tp ranks consecutive, the sp ranks 2 apart) equal one process.

One spawn of 4 ranks runs, in turn:
- the actor and reference workers of a tiny Qwen2 decoder with all-linear LoRA adapters (`test_tensor_parallel_lora`'s
  run: 2 AdamW updates, the reference the base model on the actor's groups) under TP x SP: the metrics, the last
  step's adapter gradients, the weights after the updates (the base frozen), the merged layers the engine receives,
  the log-probs and the reference's;
- MTP training of a tiny MiMo with 2 MTP layers (`test_mtp_parallel`'s model; `detach_encoder` on and off) under TP x
  SP: the update's metrics (`actor/mtp_losses/mtp_<k>_loss` each on its own), the last step's gradients of the MTP
  layers and of the main model, and the weights after 2 updates.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel

from .test_mtp_parallel import MTP
from .test_mtp_parallel import mimo_model as mimo_with_mtp
from .test_parallel import COMPARED, LORA, run_ranks, tiny_model, train

pytestmark = pytest.mark.slow

T, S = 2, 2
WORLD = T * S
TP_KEY = "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size"
SP_KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
PACKED = "actor_rollout_ref.model.use_remove_padding=true"
# the actor's TP x SP (the reference follows the actor's groups under LoRA: its Ulysses size is the actor's); the KL
# in the reward gives the reference a pass of its own
TP_SP = (f"{TP_KEY}={T}", f"actor_rollout_ref.ref.fsdp_config.tensor_parallel_size={T}", f"{SP_KEY}={S}")
LORA_RUN = (PACKED, "algorithm.use_kl_in_reward=true", *LORA)
MTP_METRICS = ("actor/mtp_losses/mtp_1_loss", "actor/mtp_losses/mtp_2_loss")
UPDATES = range(2)
PLACES = [(0, 0), (1, 0), (0, 1), (1, 1)]     # tp innermost: ranks 0, 1 a tensor-parallel group, 0, 2 a sequence-
                                               # parallel one


def mimo_model():
    """`test_mtp_parallel.mimo_model` with 2 MTP layers."""
    return mimo_with_mtp(layers=2)


def lora_job(world: int) -> dict:
    return train(world, -1, steps=UPDATES, tp=WORLD if world > 1 else 1,
                 overrides=TP_SP * (world > 1) + LORA_RUN, engine=True, grads=True, log_probs=True, ref=True)


def mtp_job(world: int, *, detach: bool) -> dict:
    overrides = (*MTP, f"actor_rollout_ref.model.mtp.detach_encoder={str(detach).lower()}",
                 *(f"{TP_KEY}={T}", f"{SP_KEY}={S}") * (world > 1))
    return train(world, -1, steps=UPDATES, tp=WORLD if world > 1 else 1, overrides=overrides, grads=True,
                 model_fn=mimo_model)


def job(world: int, *, kind: str, **kw) -> dict:
    return lora_job(world) if kind == "lora" else mtp_job(world, **kw)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    lora, *mtp = run_ranks(WORLD, tmp_path_factory.mktemp("tp_sp_three"), dict(kind="lora"),
                           dict(kind="mtp", detach=True), dict(kind="mtp", detach=False), fn=job)
    return lora, dict(zip((True, False), mtp))


def _same_metrics(got: list[dict], want: list[dict], keys=COMPARED) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert_close_rel([a[k] for k in keys], [b[k] for k in keys], rel=1e-5, name="metrics")


def test_lora_with_tp_2_x_sp_2_updates_as_one_process(four_ranks):
    ranks, one = four_ranks[0], lora_job(1)
    got = ranks[0]
    assert [r["places"] for r in ranks] == PLACES
    assert got["mesh"][0] == (WORLD // T, T)          # FSDP over world / T ranks (the sp ranks among them) x TP
    _same_metrics(got["metrics"][:-1], one["metrics"][:-1])
    adapters = sorted(one["grads"])
    assert len(adapters) == 2 * 7 * 2 and all(".lora_" in n for n in adapters)   # all-linear: 7 layers x 2 blocks
    for rank in ranks:                                # every rank of the block scores and holds the whole share
        assert sorted(rank["grads"]) == adapters
        assert_close_rel(rank["grads"], one["grads"], rel=1e-5, name="last step's adapter gradients")
        assert_close_rel(rank["metrics"][-1]["old_log_probs"], one["metrics"][-1]["old_log_probs"], rel=1e-5,
                         name="log-probs after the updates")
        assert_close_rel(rank["ref_log_prob"], one["ref_log_prob"], rel=1e-5, name="reference log-probs")
        assert_close_rel(rank["engine"], one["engine"], rel=1e-5, name="engine weights")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    start = tiny_model().state_dict()
    assert all(torch.equal(got["weights"][k], start[k]) for k in start)             # the base frozen
    assert all(got["weights"][k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))


@pytest.mark.parametrize("detach", [True, False])
def test_mtp_training_with_tp_2_x_sp_2_updates_as_one_process(four_ranks, detach):
    ranks, one = four_ranks[1][detach], mtp_job(1, detach=detach)
    got = ranks[0]
    assert [r["places"] for r in ranks] == PLACES
    assert got["mesh"][0] == (WORLD // T, T)
    assert all(one["metrics"][0][k] > 0 for k in MTP_METRICS)
    _same_metrics(got["metrics"], one["metrics"])
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        for k in MTP_METRICS:                         # each on its own: a small part of the metrics' norm
            assert abs(a[k] - b[k]) <= 1e-5 * b[k], k
    mtp = {k for k in one["grads"] if k.startswith("model.mtp_layers.")}
    assert mtp and set(got["grads"]) == set(one["grads"])
    for part, keys in (("MTP layers'", mtp), ("main model's", set(one["grads"]) - mtp)):
        assert_close_rel({k: got["grads"][k] for k in sorted(keys)}, {k: one["grads"][k] for k in sorted(keys)},
                         rel=1e-5, name=f"{part} gradients, detach_encoder={detach}")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
