"""LoRA (`lathe.models.lora` and the actor worker with `lora_rank > 0`): the adapted model's logits against the
merged weights computed independently in float64, PEFT loading lathe's adapter to the same logits, only the
adapters training, the reference as the base model, the engine on the merged weights, and an exact resume."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import assert_close_rel, plan_of
from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model
from lathe.models.lora import adapters_disabled, apply_lora, load_adapter, read_adapter, save_adapter
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


def adapted(make_lathe, *, rank=4, alpha=8, targets="all-linear", exclude=None, seed=0):
    """The tiny lathe model of seed 0 with LoRA whose A and B are random from `seed` (a fresh adapter, B = 0, is the
    base model exactly)."""
    model = make_lathe(0)
    names = apply_lora(model, rank=rank, alpha=alpha, target_modules=targets, exclude_modules=exclude, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for path in names:
            b = model.get_submodule(path).lora_B
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model.eval(), names


def ids():
    return torch.randint(2, 40, (3, 9), generator=torch.Generator().manual_seed(5))


def test_the_adapted_logits_are_those_of_the_merged_weights_computed_independently(make_lathe):
    model, names = adapted(make_lathe, targets=["q_proj", "v_proj", "down_proj"], exclude=["layers.1.self_attn.q_proj"])
    assert "model.layers.1.self_attn.q_proj" not in names and "model.layers.1.self_attn.v_proj" in names
    assert len(names) == 5
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{p}.{leaf}" for p in names for leaf in ("lora_A", "lora_B")}
    plain = make_lathe(0).eval()                            # the same base weights
    with torch.no_grad():
        for path in names:                                  # W + (alpha / r) B A, in float64, by hand
            layer = model.get_submodule(path)
            merged = layer.weight.double() + (8 / 4) * layer.lora_B.double() @ layer.lora_A.double()
            plain.get_submodule(path).weight.copy_(merged.float())
        assert_close_rel(model(ids()).logits, plain(ids()).logits, rel=1e-5, name="adapted vs merged logits")
        with adapters_disabled(model):
            assert torch.equal(model(ids()).logits, make_lathe(0).eval()(ids()).logits)


def test_peft_loads_the_saved_adapter_and_computes_the_same_logits(make_lathe, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    from transformers import AutoModelForCausalLM
    for case, (targets, exclude) in {"all": ("all-linear", None),
                                     "some": (["q_proj", "up_proj"], ["layers.0.mlp.up_proj"])}.items():
        model, _ = adapted(make_lathe, targets=targets, exclude=exclude)
        make_lathe(0).save_pretrained(tmp_path / f"base-{case}")
        save_adapter(model, tmp_path / f"adapter-{case}", base_model=str(tmp_path / f"base-{case}"))
        base = AutoModelForCausalLM.from_pretrained(tmp_path / f"base-{case}", dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(base, tmp_path / f"adapter-{case}").eval()
        with torch.no_grad():
            assert_close_rel(peft_model(ids()).logits, model(ids()).logits, rel=1e-5, name=f"peft vs lathe ({case})")
        # and back: the adapter PEFT saves loads into lathe
        peft_model.save_pretrained(tmp_path / f"resaved-{case}")
        again, _ = adapted(make_lathe, targets=targets, exclude=exclude, seed=3)
        load_adapter(again, read_adapter(tmp_path / f"resaved-{case}")[1], "resaved")
        with torch.no_grad():
            assert_close_rel(again(ids()).logits, model(ids()).logits, rel=1e-6, name=f"reloaded ({case})")


def test_an_adapter_of_another_rank_is_refused_by_name(make_lathe, tmp_path):
    model, _ = adapted(make_lathe, rank=4)
    save_adapter(model, tmp_path / "a")
    other, _ = adapted(make_lathe, rank=2)
    with pytest.raises(ValueError, match=r"lora_A has shape \(4, 32\).*set lora_rank to the adapter's r"):
        load_adapter(other, read_adapter(tmp_path / "a")[1], "the adapter")
    with pytest.raises(ValueError, match="matches no linear layer.*Fix: name some of"):
        apply_lora(make_lathe(0), rank=2, alpha=4, target_modules=["qkv_proj"])


def worker(load_cfg, *overrides):
    cfg = load_cfg("actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.model.use_remove_padding=true",
                   "actor_rollout_ref.actor.use_kl_loss=true", *LORA, *overrides)
    tok = builtin_tokenizer()
    return ActorRolloutRefWorker(cfg, build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok,
                                 plan=plan_of(cfg, needs_ref=True), total_steps=10, device=torch.device("cpu"))


def ppo_batch(w, rollout_batch, seed=1):
    batch = rollout_batch(rows=8, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = w.compute_log_prob(batch)["old_log_probs"]
    batch["advantages"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    batch["ref_log_prob"] = w.compute_ref_log_prob(batch)["ref_log_prob"]
    return batch


def test_only_the_adapters_train_the_reference_is_the_base_and_the_engine_gets_the_merged_weights(
        load_cfg, rollout_batch):
    w = worker(load_cfg)
    assert w.ref.model is None and w.has_ref, "no second copy of the weights for the reference"
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    for seed in (1, 3):
        w.update_actor(ppo_batch(w, rollout_batch, seed))
    w.sync_weights()
    after = w.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("lora_A", "lora_B")) for k in changed), changed
    assert any(k.endswith("lora_B") for k in changed), "B left zero: the adapters did not learn"
    batch = rollout_batch(rows=8, seed=7)
    with adapters_disabled(w.model):
        base = w.compute_log_prob(batch)["old_log_probs"]
    assert torch.equal(w.compute_ref_log_prob(batch)["ref_log_prob"], base)
    assert not torch.equal(w.compute_log_prob(batch)["old_log_probs"], base)
    engine = w.rollout.backend.model
    merged = copy.deepcopy(w.model)
    with torch.no_grad():
        for path, layer in [(p, m) for p, m in merged.named_modules() if hasattr(m, "lora_A")]:
            engine_w = engine.get_submodule(path).weight
            assert_close_rel(engine_w, layer.weight.double() + layer.scaling * layer.lora_B.double()
                             @ layer.lora_A.double(), rel=1e-6, name=f"engine {path}")


def test_a_lora_checkpoint_resumes_exactly_and_holds_a_peft_adapter_and_the_merged_model(
        load_cfg, rollout_batch, tmp_path):
    from transformers import AutoModelForCausalLM
    w = worker(load_cfg)
    w.update_actor(ppo_batch(w, rollout_batch, 1))
    w.save_checkpoint(tmp_path / "actor")
    assert (tmp_path / "actor" / "lora_adapter" / "adapter_config.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "actor" / "huggingface", dtype=torch.float32).eval()
    x = ids() % 100 + 7
    with torch.no_grad():
        assert_close_rel(hf(x).logits, w.model.eval()(x).logits, rel=1e-5, name="merged export vs adapted")
    second = ppo_batch(w, rollout_batch, 3)
    expected = w.update_actor(second)
    restored = worker(load_cfg)
    restored.load_checkpoint(tmp_path / "actor")
    got = restored.update_actor(second)
    assert got["actor/pg_loss"] == expected["actor/pg_loss"] and got["actor/grad_norm"] == expected["actor/grad_norm"]
    for k, v in w.model.state_dict().items():
        assert torch.equal(v, restored.model.state_dict()[k]), k


def test_a_run_starts_from_an_existing_peft_adapter(load_cfg, rollout_batch, tmp_path):
    w = worker(load_cfg)
    w.update_actor(ppo_batch(w, rollout_batch, 1))
    w.sync_weights()                                  # (the loop syncs the engine after each update)
    save_adapter(w.model, tmp_path / "adapter")
    started = worker(load_cfg, f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}")
    batch = rollout_batch(rows=8, seed=9)
    assert_close_rel(started.compute_log_prob(batch)["old_log_probs"], w.compute_log_prob(batch)["old_log_probs"],
                     rel=1e-6, name="log-probs from the loaded adapter")
    assert_close_rel(started.rollout.backend.model.model.layers[0].self_attn.q_proj.weight,
                     w.rollout.backend.model.model.layers[0].self_attn.q_proj.weight, rel=1e-6,
                     name="the engine starts from the merged adapter")
