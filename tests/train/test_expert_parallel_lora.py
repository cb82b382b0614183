"""LoRA beside expert parallelism: on 2 gloo ranks with EP 2 (each rank 2 of a tiny Qwen3-MoE's 4 experts whole,
frozen; the adapters and the other weights FSDP-sharded over both), 2 updates of the adapters equal one process
without EP: the metrics (the loss among them), the last step's adapter gradients, the adapters after the updates,
the merged layers the rollout engine receives (only the adapted ones: the experts never change, so the sync sends
none of them) and the reference's log-probs (the base model: the adapters off). The experts end as they started,
and the checkpoint the EP run writes (the adapter, the merged model with its experts under their per-expert Hugging
Face names) resumes exactly in one process.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel
from safetensors import safe_open

from lathe.train.logprob import response_log_probs

from .test_expert_parallel import EP_KEY, tiny_moe
from .test_parallel import COMPARED, LORA, SAVED_AFTER, STEPS, ppo_batch, run_ranks, train

pytestmark = pytest.mark.slow

UPDATES = range(SAVED_AFTER)           # the EP run's checkpoint holds the state after its last update


def lora_job(world: int, *, ep: int, save=None) -> dict:
    overrides = (f"{EP_KEY}={ep}",) * (ep > 1) + LORA
    return train(world, -1, steps=UPDATES, model_fn=tiny_moe, overrides=overrides, engine=True, grads=True, ref=True,
                 save=save)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_lora")
    [ranks] = run_ranks(2, root, dict(ep=2, save=root / "ckpt"), fn=lora_job)
    return ranks, lora_job(1, ep=1), root / "ckpt"


def test_lora_beside_ep_2_updates_the_adapters_as_one_process(runs):
    ranks, one, _ = runs
    got = ranks[0]
    assert got["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (1, 2))       # the experts: EP 2, not sharded further
    for a, b in zip(got["metrics"], one["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    adapters = sorted(one["grads"])
    assert adapters and all(".lora_" in n and ".experts." not in n for n in adapters)       # only adapters train
    assert sorted(got["grads"]) == adapters
    assert_close_rel(got["grads"], one["grads"], rel=1e-5, name="last step's adapter gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    start = tiny_moe().state_dict()
    experts = [k for k in start if ".mlp.experts." in k]
    assert experts and all(torch.equal(got["weights"][k], start[k]) for k in experts)       # frozen, unchanged
    assert all(got["weights"][k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))   # B left zero


def test_engine_receives_the_merged_adapted_layers_only(runs):
    ranks, one, _ = runs
    assert one["engine"] and all(k.endswith("_proj.weight") and ".experts." not in k for k in one["engine"])
    for rank in ranks:                                # every rank iterates the sync: the same whole tensors
        assert sorted(rank["engine"]) == sorted(one["engine"])
        assert_close_rel(rank["engine"], one["engine"], rel=1e-5, name="engine weights")


def test_reference_is_the_base_model_with_the_adapters_off(runs):
    ranks, one, _ = runs
    batch = ppo_batch(STEPS)                          # what `train` scores after its updates
    with torch.no_grad():
        base, _ = response_log_probs(tiny_moe().eval(), batch)
    assert_close_rel(one["ref_log_prob"], base, rel=1e-5, name="one process's reference")
    assert_close_rel(torch.cat([r["ref_log_prob"] for r in ranks]), base, rel=1e-5, name="EP 2 reference")


def test_ep_lora_checkpoint_resumes_exactly_in_one_process(runs):
    *_, ckpt = runs
    last = range(SAVED_AFTER, STEPS)
    one = train(1, -1, model_fn=tiny_moe, overrides=LORA)
    resumed = train(1, -1, steps=last, resume=ckpt, model_fn=tiny_moe, overrides=LORA)
    for a, b in zip(resumed["metrics"], one["metrics"][SAVED_AFTER:], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(resumed["weights"], one["weights"], rel=1e-5, name="weights")
    names = set()
    for f in (ckpt / "huggingface").glob("*.safetensors"):
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    assert {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert (ckpt / "lora_adapter" / "adapter_model.safetensors").is_file()
