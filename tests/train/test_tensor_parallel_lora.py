"""LoRA beside tensor parallelism (`lathe.train.tensor_parallel`'s adapter layout): on one group of 2 gloo ranks, the
actor of a tiny Qwen2 decoder (q/k/v biases; and a Qwen3 one: q/k norms, tied embeddings) with adapters on every
linear layer (all-linear; and a GLM-4 one: norms on the attention's and MLP's outputs) updates exactly as one
process does over 2 AdamW steps: the metrics, the last step's adapter gradients (whole on every rank: a replicated
adapter's gradient is not a partial sum), the adapters after the updates and the log-probs after them. The base
weights stay frozen; the reference (the adapters off) is the base model; the rollout engine receives the whole
merged layers; the checkpoint written under TP 2 holds
the one-process adapter (PEFT's layout, whole tensors) and resumes exactly in one process. On 4 ranks (FSDP 2 x TP 2:
the adapters 2-D DTensors) the updates equal one process's too.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_close_rel
from safetensors.torch import load_file

from lathe.models.decoder import LatheCausalLM
from lathe.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lathe.train.logprob import response_log_probs

from .test_parallel import COMPARED, LORA, SAVED_AFTER, STEPS, ppo_batch, run_ranks, tiny_model, train

pytestmark = pytest.mark.slow

T = 2
TP_KEY = "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size"
UPDATES = range(SAVED_AFTER)            # the checkpoint holds the state after the last of them


def tiny_qwen3() -> LatheCausalLM:
    """Qwen3-shaped (q/k norms, no biases), tied embeddings, 2 layers, the same weights in every process."""
    return tiny_model(1, architectures=["Qwen3ForCausalLM"], head_dim=8, tie_word_embeddings=True)


def tiny_glm4() -> LatheCausalLM:
    """GLM-4-shaped (q/k/v biases, RoPE over half of each head, its q/k rows permuted: `lathe.models.glm4`; norms on
    the attention's and MLP's outputs), 2 layers."""
    return tiny_model(2, architectures=["Glm4ForCausalLM"], head_dim=8)


def lora_job(world: int, *, save=None, model_fn=None) -> dict:
    """2 updates (saved after them) of the one-process actor or of a rank of one TP group, then log-probs (and the
    reference's: the actor's model with its adapters off)."""
    return train(world, -1, steps=UPDATES, tp=T if world > 1 else 1, overrides=(f"{TP_KEY}={T}",) * (world > 1) + LORA,
                 engine=True, grads=True, log_probs=True, save=save, model_fn=model_fn, ref=model_fn is None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora")
    one = lora_job(1, save=root / "one")
    ranks, qwen3, glm4 = run_ranks(T, root / "ranks", dict(save=root / "tp"), dict(model_fn=tiny_qwen3),
                                   dict(model_fn=tiny_glm4), fn=lora_job)
    return ranks, one, root, qwen3, glm4


def assert_same_updates(ranks: list[dict], one: dict, model_fn) -> None:
    """The metrics, log-probs, adapter gradients and weights of a TP run against one process's; the base frozen."""
    got = ranks[0]
    for a, b in zip(got["metrics"][:-1], one["metrics"][:-1], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    for rank in ranks:                          # both ranks of the group score the same share
        assert_close_rel(rank["metrics"][-1]["old_log_probs"], one["metrics"][-1]["old_log_probs"], rel=1e-5,
                         name="log-probs after the updates")
    adapters = sorted(one["grads"])
    assert len(adapters) == 2 * 7 * 2 and all(".lora_" in n for n in adapters)   # all-linear: 7 layers x 2 blocks
    for rank in ranks:
        assert sorted(rank["grads"]) == adapters
        assert_close_rel(rank["grads"], one["grads"], rel=1e-5, name="last step's adapter gradients")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")
    start = model_fn().state_dict()
    base = [k for k in start if ".lora_" not in k]
    assert all(torch.equal(got["weights"][k], start[k]) for k in base)               # frozen, unchanged
    assert all(got["weights"][k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))


def test_tp_2_with_lora_updates_as_one_process(runs):
    ranks, one, *_ = runs
    assert ranks[0]["mesh"][0] == (1, 2)
    assert_same_updates(ranks, one, tiny_model)
    layout = ranks[0]["grad_layout"]      # (FSDP over 1 rank, tp): Megatron's layout, each gradient as its weight
    for path, column in (("self_attn.q_proj", True), ("mlp.down_proj", False)):
        a, b = (layout[f"model.layers.0.{path}.{leaf}"] for leaf in ("lora_A", "lora_B"))
        assert a == ((("S0", "R"),) * 2 if column else (("S0", "S1"),) * 2)
        assert b == ((("S0", "S0"),) * 2 if column else (("S0", "R"),) * 2)


def test_fsdp_2_x_tp_2_with_lora_updates_as_one_process(runs, tmp_path):
    """4 ranks: the adapters are 2-D DTensors (FSDP's shard over the data-parallel ranks x the tp placement)."""
    _, one, *_ = runs
    [ranks] = run_ranks(2 * T, tmp_path, dict(), fn=lora_job)
    got = ranks[0]
    assert got["mesh"][0] == (2, 2)
    assert got["grad_layout"]["model.layers.0.self_attn.q_proj.lora_A"] == (("S0", "R"),) * 2
    assert got["grad_layout"]["model.layers.0.mlp.down_proj.lora_A"] == (("S0", "S1"),) * 2
    for a, b in zip(got["metrics"][:-1], one["metrics"][:-1], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    for rank in ranks:
        assert_close_rel(rank["grads"], one["grads"], rel=1e-5, name="last step's adapter gradients")
        assert_close_rel(rank["engine"], one["engine"], rel=1e-5, name="engine weights")
    assert_close_rel(got["weights"], one["weights"], rel=1e-5, name="weights")


def test_tp_2_with_lora_updates_a_tied_qwen3_as_one_process(runs):
    *_, qwen3, _ = runs
    assert_same_updates(qwen3, lora_job(1, model_fn=tiny_qwen3), tiny_qwen3)


def test_tp_2_with_lora_updates_a_glm4_as_one_process(runs):
    """GLM-4's post norms replicated beside the cut projections; its q/k rows permuted within each head."""
    *_, glm4 = runs
    assert tiny_glm4().config.rope_interleave
    assert_same_updates(glm4, lora_job(1, model_fn=tiny_glm4), tiny_glm4)


def test_reference_is_the_base_model_on_the_actors_groups(runs):
    ranks, *_ = runs
    with torch.no_grad():
        base, _ = response_log_probs(tiny_model().eval(), ppo_batch(STEPS))   # what `train` scores after its updates
    for rank in ranks:                          # one group: both ranks score the whole batch
        assert_close_rel(rank["ref_log_prob"], base, rel=1e-5, name="TP 2 reference")


def test_engine_receives_the_whole_merged_layers(runs):
    ranks, one, *_ = runs
    assert len(one["engine"]) == 2 * 7
    for rank in ranks:                          # every rank iterates the sync: the same whole tensors
        assert sorted(rank["engine"]) == sorted(one["engine"])
        assert_close_rel(rank["engine"], one["engine"], rel=1e-5, name="engine weights")


def test_tp_checkpoint_holds_the_one_process_adapter_and_resumes_in_one_process(runs):
    _, _, root, *_ = runs
    got, expected = (load_file(root / d / "lora_adapter" / ADAPTER_WEIGHTS) for d in ("tp", "one"))
    assert sorted(got) == sorted(expected) and all(k.startswith("base_model.model.model.layers.") for k in got)
    assert all(got[k].shape == expected[k].shape for k in got)                      # whole, PEFT's layout
    assert_close_rel(got, expected, rel=1e-5, name="saved adapter")
    configs = [json.loads((root / d / "lora_adapter" / ADAPTER_CONFIG).read_text()) for d in ("tp", "one")]
    assert configs[0] == configs[1]               # PEFT loads it as the one-process adapter (tests/train/test_lora)
    merged, merged_one = ({k: v for f in (root / d / "huggingface").glob("*.safetensors")
                           for k, v in load_file(f).items()} for d in ("tp", "one"))
    assert_close_rel(merged, merged_one, rel=1e-5, name="merged model")
    last = range(SAVED_AFTER, STEPS)
    resumed = train(1, -1, steps=last, resume=root / "tp", overrides=LORA)
    uninterrupted = train(1, -1, steps=last, resume=root / "one", overrides=LORA)
    for a, b in zip(resumed["metrics"], uninterrupted["metrics"], strict=True):
        assert_close_rel([a[k] for k in COMPARED], [b[k] for k in COMPARED], rel=1e-5, name="metrics")
    assert_close_rel(resumed["weights"], uninterrupted["weights"], rel=1e-5, name="weights")


def test_lora_dropout_is_refused_and_plain_lora_cuts():
    from lathe.models.lora import apply_lora
    from lathe.train.tensor_parallel import check_model
    model = tiny_model()
    apply_lora(model, rank=4, alpha=8)
    check_model(model, T, TP_KEY)
    apply_lora(model := tiny_model(), rank=4, alpha=8, dropout=0.1)
    with pytest.raises(ValueError, match=f"LoRA dropout .* Fix: set lora_dropout=0 \\(or {TP_KEY}=1\\)"):
        check_model(model, T, TP_KEY)
