"""MiMo in lathe's decoder: the main model is exactly Qwen2, and the multi-token-prediction layers load and save under
the checkpoint's own names (`lathe.models.mtp`, `lathe.models.io`)."""

from __future__ import annotations

import logging

import pytest
import torch

from lathe.models import load_lathe_model, load_lathe_value_model
from lathe.models.config import LatheConfig
from lathe.models.io import read_state_dict
from lathe.models.mtp import has_mtp, roll_packed
from lathe.models.packing import pack_padded

from models.lathe_tiny import ragged_batch
from models.mimo_tiny import save_mimo


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_config_reads_mimo_as_qwen2_with_mtp_layers(tmp_path):
    path, _ = save_mimo(tmp_path / "m", layers=2)
    cfg = LatheConfig.from_pretrained(path)
    assert cfg.architecture == "MiMoForCausalLM" and cfg.family == "mimo"
    assert cfg.qkv_bias and not cfg.o_bias and cfg.num_mtp_layers == 2
    no_arch = {k: v for k, v in cfg.hf_config.items() if k != "architectures"}
    assert LatheConfig.from_hf_dict(no_arch).architecture == "MiMoForCausalLM"     # by model_type


def test_main_model_logits_equal_transformers_qwen2_on_a_packed_ragged_batch(tmp_path):
    path, hf = save_mimo(tmp_path / "m")
    model = load_lathe_model(path)
    assert has_mtp(model)
    ids, mask, pos = ragged_batch(seed=3)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
        packed = pack_padded(ids, mask, pos)
        got = model.forward_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                   return_hidden=False)
    assert rel(got, want) < 1e-5


def test_roll_packed_never_crosses_a_sequence():
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    cu = torch.tensor([0, 3, 3, 6], dtype=torch.int32)         # an empty sequence in the middle
    assert roll_packed(ids, cu).tolist() == [2, 3, 0, 5, 6, 0]
    assert roll_packed(roll_packed(ids, cu), cu).tolist() == [3, 0, 0, 6, 0, 0]


def test_save_and_load_keep_the_mtp_tensors_bit_exact(tmp_path):
    path, _ = save_mimo(tmp_path / "m", layers=2)
    model = load_lathe_model(path)
    model.save_pretrained(tmp_path / "out")
    before, after = read_state_dict(path), read_state_dict(tmp_path / "out")
    mtp = sorted(k for k in before if k.startswith("model.mtp_layers."))
    assert len(mtp) == 2 * 16 and set(after) == set(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = load_lathe_model(tmp_path / "out")
    assert again.config.num_mtp_layers == 2 and again.config.hf_config["num_nextn_predict_layers"] == 2


def test_a_checkpoint_without_its_mtp_tensors_loads_without_them_and_says_so(tmp_path, caplog):
    path, _ = save_mimo(tmp_path / "m", with_mtp=False)
    with caplog.at_level(logging.WARNING, logger="lathe"):
        model = load_lathe_model(path)
    assert not has_mtp(model) and model.config.num_mtp_layers == 0
    assert any("no model.mtp_layers.* tensors" in r.getMessage() for r in caplog.records)


def test_the_critic_built_from_a_mimo_policy_leaves_the_mtp_layers_out(tmp_path):
    path, _ = save_mimo(tmp_path / "m")
    critic = load_lathe_value_model(path)
    assert not has_mtp(critic)


def test_deepseek_v3_mtp_tensors_are_dropped_with_a_log_line(tmp_path, caplog):
    from lathe.models.decoder import LatheCausalLM
    from lathe.models.io import load_into

    from models.deepseek_tiny import deepseek_config
    d = deepseek_config().to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg = LatheConfig.from_hf_dict(d)
    with torch.device("meta"):
        model = LatheCausalLM(cfg)
    state = {k: torch.zeros(v.shape) for k, v in LatheCausalLM(cfg).state_dict().items()}
    state[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = torch.zeros(4, 8)
    with caplog.at_level(logging.WARNING, logger="lathe"):
        load_into(model, state, "tiny-deepseek")
    assert any("multi-token-prediction layers" in r.getMessage() and "leave them out" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("layers", [1, 2])
def test_parameter_names_are_mimos_checkpoint_names(tmp_path, layers):
    path, _ = save_mimo(tmp_path / "m", layers=layers)
    model = load_lathe_model(path)
    assert set(model.state_dict()) == set(read_state_dict(path))
