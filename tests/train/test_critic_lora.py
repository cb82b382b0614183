"""A LoRA critic (`critic.model.lora_rank` > 0; `lathe.workers.critic` with `lathe.train.lora`): only the adapters
and the value head train, their gradients equal those of the merged model written out by hand (W + (alpha/r) B A),
its checkpoint holds a PEFT TOKEN_CLS adapter with the head and the merged value model and resumes exactly, and
what it cannot run is refused naming the key and the fix."""

from __future__ import annotations

import json

import pytest
import torch

from lathe.algo import compute_value_loss
from lathe.config import ConfigError
from lathe.models.lora import ADAPTER_CONFIG, has_lora, read_adapter
from lathe.train.critic import response_values

from helpers import assert_close_rel

from .test_critic import CRITIC, _critic_batch, _value_model, _worker

RANK, ALPHA = 4, 8
LORA = [f"critic.model.lora_rank={RANK}", f"critic.model.lora_alpha={ALPHA}", "critic.model.use_remove_padding=true"]


# a warm-up whose first update moves (verl's starts at 0)
WARM = ("critic.optim.lr_warmup_steps=3", "critic.optim.lr_warmup_init=2.5e-4")


def lora_worker(load_cfg, *overrides, seed=0):
    return _worker(load_cfg(*CRITIC, *LORA, *overrides), model=_value_model(seed))


def head_and_adapters(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if n.startswith("score.") or n.endswith((".lora_A", ".lora_B"))}


def test_only_the_adapters_and_the_head_train_and_the_optimizer_holds_only_them(load_cfg, rollout_batch):
    w = lora_worker(load_cfg)
    trained = {n for n, p in w.model.named_parameters() if p.requires_grad}
    assert trained == head_and_adapters(w.model) and {"score.weight", "score.bias"} <= trained
    assert len([n for n in trained if n.endswith("lora_A")]) == 2 * 7, "all-linear: 7 layers x 2 blocks"
    held = {id(p) for g in w.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in w.model.parameters() if p.requires_grad}
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    for seed in (1, 2):
        w.update_critic(_critic_batch(w, rollout_batch, seed=seed))
    after = w.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    base = set(before) - head_and_adapters(w.model)
    assert not changed & base, f"frozen weights changed: {sorted(changed & base)[:4]}"
    assert "score.weight" in changed and any(k.endswith("lora_B") for k in changed)


def test_target_modules_choose_the_adapted_layers(load_cfg):
    w = lora_worker(load_cfg, "critic.model.target_modules=[q_proj,v_proj]")
    adapted = {n.rsplit(".", 2)[-2] for n in head_and_adapters(w.model) if ".lora_" in n}
    assert adapted == {"q_proj", "v_proj"}
    assert w.model.model.layers[0].self_attn.q_proj.scaling == ALPHA / RANK


def test_adapter_gradients_equal_those_of_the_merged_weights_written_out_by_hand(load_cfg, rollout_batch):
    """dL/dB = s G A^T and dL/dA = s B^T G, with G = dL/dW' the gradient of the plain model holding W' = W + s B A,
    and the head's gradient that of the plain model's head."""
    w = lora_worker(load_cfg)
    plain = _worker(load_cfg(*CRITIC, "critic.model.use_remove_padding=true"), model=_value_model(0))
    g = torch.Generator().manual_seed(3)
    s = ALPHA / RANK
    adapted = {p: m for p, m in w.model.named_modules() if hasattr(m, "lora_A")}
    with torch.no_grad():
        for path, layer in adapted.items():        # B random, so that A's gradient is not zero either
            layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=g))
            plain.model.get_submodule(path).weight.copy_(layer.weight + s * layer.lora_B @ layer.lora_A)
    batch = _critic_batch(w, rollout_batch, seed=4)
    for model in (w.model, plain.model):
        model.train()
        model.zero_grad(set_to_none=True)
        values = response_values(model, batch, remove_padding=True)
        loss, _ = compute_value_loss(values, batch["returns"], batch["values"], batch["response_mask"], 0.5)
        loss.backward()
    got, want = {}, {}
    for path, layer in adapted.items():
        G = plain.model.get_submodule(path).weight.grad.double()
        A, B = layer.lora_A.detach().double(), layer.lora_B.detach().double()
        got[f"{path}.lora_A"], want[f"{path}.lora_A"] = layer.lora_A.grad, s * B.T @ G
        got[f"{path}.lora_B"], want[f"{path}.lora_B"] = layer.lora_B.grad, s * G @ A.T
    for leaf in ("weight", "bias"):
        got[f"score.{leaf}"], want[f"score.{leaf}"] = (getattr(m.score, leaf).grad for m in (w.model, plain.model))
    assert_close_rel(got, want, rel=1e-4, name="LoRA critic gradients vs the merged model's")
    assert all(layer.weight.grad is None for layer in adapted.values()), "the base got a gradient"


def test_a_lora_critic_checkpoint_holds_a_peft_adapter_and_the_merged_model_and_resumes_exactly(
        load_cfg, rollout_batch, tmp_path):
    w = lora_worker(load_cfg, *WARM)
    w.update_critic(_critic_batch(w, rollout_batch, seed=1))
    w.save_checkpoint(tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "lora_adapter" / ADAPTER_CONFIG).read_text())
    assert config["task_type"] == "TOKEN_CLS" and config["modules_to_save"] == ["score"] and config["r"] == RANK
    _, tensors = read_adapter(tmp_path / "critic" / "lora_adapter")
    assert set(tensors) == head_and_adapters(w.model)
    second = _critic_batch(w, rollout_batch, seed=2)
    merged = _worker(load_cfg(*CRITIC, f"critic.model.path={tmp_path / 'critic' / 'huggingface'}",
                              "critic.model.use_remove_padding=true"))
    assert not has_lora(merged.model)
    assert_close_rel(merged.compute_values(second)["values"], w.compute_values(second)["values"], rel=1e-5,
                     name="the merged value model (what lathe export copies) vs the adapted one")

    expected = w.update_critic(second)
    restored = lora_worker(load_cfg, *WARM)                                 # the same base (not in the checkpoint)
    with torch.no_grad():
        restored.model.score.weight.mul_(-2)                                # another head: the file's wins
    restored.load_checkpoint(tmp_path / "critic")
    got = restored.update_critic(second)
    assert got == expected
    for k, v in w.model.state_dict().items():
        assert torch.equal(v, restored.model.state_dict()[k]), k


def test_peft_loads_the_critic_adapter_with_its_head_to_the_same_values(load_cfg, rollout_batch, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    from transformers import AutoModelForTokenClassification
    w = lora_worker(load_cfg)
    batch = _critic_batch(w, rollout_batch, seed=1)
    w.update_critic(batch)
    _value_model(0).save_pretrained(tmp_path / "base")
    w.save_checkpoint(tmp_path / "critic")
    base = AutoModelForTokenClassification.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "critic" / "lora_adapter").eval()
    with torch.no_grad():
        values = response_values(model, batch)
    assert_close_rel(values, w.compute_values(batch)["values"], rel=1e-5, name="PEFT vs lathe LoRA critic")


def test_a_lora_critic_resumed_without_lora_or_on_transformers_is_refused_naming_the_fix(load_cfg, tmp_path):
    w = _worker(load_cfg(*CRITIC), model=_value_model())
    w.save_checkpoint(tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="saved by a run without LoRA.*lora_rank=0"):
        lora_worker(load_cfg).load_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match=r"critic.model.target_modules=\['qkv'\].*Fix: name some of"):
        lora_worker(load_cfg, "critic.model.target_modules=[qkv]")
    with pytest.raises(ConfigError, match=r"critic.model.lora_rank=4.*actor_rollout_ref.model.impl=hf.*Fix"):
        load_cfg(*CRITIC, *LORA, "actor_rollout_ref.model.impl=hf", "algorithm.adv_estimator=gae")
