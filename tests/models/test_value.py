"""Tests for lathe.models.value: building and loading value models (token classification, num_labels=1)."""

import pytest
import torch

from lathe.dtypes import to_dtype
from lathe.models.hf import ModelLoadError, build_builtin_model
from lathe.models.value import load_value_model


def _backbone_equal(value_model, policy) -> bool:
    ref = policy.state_dict()
    keys = [k for k in value_model.state_dict() if k.startswith("model.")]
    return bool(keys) and all(torch.equal(value_model.state_dict()[k], ref[k]) for k in keys)


def test_builtin_value_model_shares_the_policy_backbone_and_starts_at_zero():
    from lathe.data.builtin import builtin_tokenizer
    model = load_value_model("builtin:tiny", seed=5)
    assert type(model).__name__ == "Qwen2ForTokenClassification"
    assert model.config.vocab_size == len(builtin_tokenizer())
    assert _backbone_equal(model, build_builtin_model("tiny", vocab_size=None, seed=5))
    assert not _backbone_equal(model, build_builtin_model("tiny", vocab_size=None, seed=6))
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    out = model(input_ids=ids).logits
    assert out.shape == (2, 7, 1) and torch.all(out == 0)
    model.train()
    assert model.dropout.p == 0.0, "dropout would make micro-batch accumulation inexact"


def test_causal_lm_directory_loads_as_critic_and_saved_critic_keeps_its_head(tmp_path):
    policy = build_builtin_model("tiny", vocab_size=None, seed=2)
    policy.save_pretrained(tmp_path / "policy")
    critic = load_value_model(str(tmp_path / "policy"))
    assert _backbone_equal(critic, policy)
    assert torch.all(critic.score.weight == 0), "a head missing from the checkpoint starts at zero"
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.25)
    critic.save_pretrained(tmp_path / "critic")
    again = load_value_model(str(tmp_path / "critic"), dtype="bf16")
    assert again.dtype == torch.bfloat16
    assert torch.equal(again.score.weight.float(), critic.score.weight.to(torch.bfloat16).float())
    assert float(again.score.bias.detach()) == 0.25


def test_missing_path_names_the_critic_key(tmp_path):
    with pytest.raises(ModelLoadError, match="critic.model.path"):
        load_value_model(str(tmp_path / "absent" / "dir"))


def test_unknown_dtype_names_the_key():
    assert to_dtype("fp32", "critic.model.fsdp_config.model_dtype") is torch.float32
    with pytest.raises(ValueError, match="model_dtype='fp8'"):
        load_value_model("builtin:tiny", dtype="fp8")


def test_a_checkpoint_lathe_runs_loads_as_lathe_s_value_model_directly(tmp_path):
    """One copy of the weights, no transformers model first: the values of transformers' token-classification
    model of the same saved critic; with impl=hf (or override_config) transformers' own model."""
    from transformers import AutoModelForTokenClassification
    from lathe.models.decoder import LatheValueModel
    policy = build_builtin_model("tiny", vocab_size=None, seed=3)
    policy.save_pretrained(tmp_path / "policy")
    critic = load_value_model(str(tmp_path / "policy"))
    assert isinstance(critic, LatheValueModel) and torch.all(critic.score.weight == 0)
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.1)
    critic.save_pretrained(tmp_path / "critic")
    ids = torch.randint(0, policy.config.vocab_size, (2, 9))
    ref = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    with torch.no_grad():
        got = load_value_model(str(tmp_path / "critic")).eval()(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    from helpers import assert_close_rel
    assert_close_rel(got, want, name="values")
    assert type(load_value_model(str(tmp_path / "critic"), impl="hf")).__name__ == "Qwen2ForTokenClassification"
    assert not isinstance(load_value_model(str(tmp_path / "critic"), override_config={"attention_dropout": 0.0}),
                          LatheValueModel)
