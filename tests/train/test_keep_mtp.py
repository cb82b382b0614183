"""`actor_rollout_ref.model.mtp.enable=true` with a checkpoint whose MTP layers lathe's decoder loads but does not run
(`lathe.train.mtp.keep_checkpoint_mtp`): the policy's saves carry them unchanged; where they cannot, a clear error.
(A GLM-4.5 run that saves, resumes and saves again with them: tests/loop/test_deepseek_steps.py.)"""

import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from lathe.models import load_lathe_model
from lathe.train.mtp import keep_checkpoint_mtp

from models.lathe_tiny import save_hf

ON, OFF = SimpleNamespace(enable=True), SimpleNamespace(enable=False)


def _with_mtp(path, extra):
    file = path / "model.safetensors"
    save_file({**load_file(str(file)), **extra}, str(file), metadata={"format": "pt"})


def test_a_qwen3_5_policy_s_saves_carry_its_mtp_block_with_enable_only(tmp_path):
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.mlp.up_proj.weight": torch.randn(96, 64)}
    _with_mtp(path, mtp)
    for cfg, want in ((OFF, {}), (ON, mtp)):
        model = load_lathe_model(path)
        keep_checkpoint_mtp(cfg, model, str(path))
        model.save_pretrained(tmp_path / "out")
        saved = load_file(str(tmp_path / "out" / "model.safetensors"))
        got = {k: v for k, v in saved.items() if k.startswith("mtp.")}
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        back = load_lathe_model(tmp_path / "out")      # (dropped again on load, with the log line)
        assert set(back.state_dict()) == set(model.state_dict())


def test_a_checkpoint_without_mtp_layers_saves_none_and_says_so(tmp_path, caplog):
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    model = load_lathe_model(path)
    with caplog.at_level(logging.WARNING, logger="lathe"):
        keep_checkpoint_mtp(ON, model, str(path))
    assert model.config.mtp_source is None
    assert any("holds no multi-token-prediction layers" in r.getMessage() for r in caplog.records)


def test_transformers_module_of_such_a_family_is_refused(tmp_path):
    from models.glm_tiny import glm_model
    with pytest.raises(ValueError, match=r"mtp.enable=true: the policy runs as Glm4MoeForCausalLM.*enable=false"):
        keep_checkpoint_mtp(ON, glm_model(), str(tmp_path))
    keep_checkpoint_mtp(OFF, glm_model(), str(tmp_path))          # off: nothing to keep
