"""`run_check`: agreement with transformers on a good checkpoint, failure on a corrupted one, fallback notice."""

import json

import torch

from lathe.cli.model_check import run_check

from models.lathe_tiny import FAMILIES, save_hf


def test_good_checkpoints_pass(tmp_path):
    for family in FAMILIES:
        path, _ = save_hf(tmp_path, family, tie=family == "qwen3")
        lines = []
        assert run_check(path, num_batches=2, out=lines.append) == 0, "\n".join(lines)
        text = "\n".join(lines)
        assert "lathe will use: lathe decoder" in text and "max |logit diff|" in text


def test_a_corrupted_weight_is_caught(tmp_path, monkeypatch):
    import lathe.cli.model_check as check
    path, _ = save_hf(tmp_path, "llama")
    load = check.load_lathe_model

    def corrupted(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
        return model

    monkeypatch.setattr(check, "load_lathe_model", corrupted)
    lines = []
    assert run_check(path, num_batches=1, out=lines.append) == 1
    assert "MISMATCH" in "\n".join(lines) and "DISAGREES" in "\n".join(lines)


def test_unsupported_architecture_reports_the_fallback(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=32)).save_pretrained(tmp_path)
    lines = []
    assert run_check(tmp_path, out=lines.append) == 0, "\n".join(lines)
    assert "transformers fallback" in "\n".join(lines) and "GPT2LMHeadModel" in "\n".join(lines)


def _rename_a_tensor(path):
    from safetensors.torch import load_file, save_file
    (file,) = path.glob("*.safetensors")
    state = load_file(file)
    state["model.layers.0.mlp.down_proj.weight_renamed"] = state.pop("model.layers.0.mlp.down_proj.weight")
    save_file(state, file, metadata={"format": "pt"})


def test_a_checkpoint_missing_a_tensor_is_refused_by_check_and_by_loading(tmp_path):
    """Neither lathe's decoder nor the transformers fallback may start a layer at random."""
    import pytest

    from lathe.models.hf import ModelLoadError, load_policy
    path, _ = save_hf(tmp_path, "llama")
    _rename_a_tensor(path)
    lines = []
    assert run_check(path, num_batches=1, out=lines.append) == 1
    text = "\n".join(lines)
    assert "BROKEN CHECKPOINT" in text and "model.layers.0.mlp.down_proj.weight" in text, text
    with pytest.raises(ModelLoadError, match=r"missing \(they would be initialised at random\): "
                                             r"model.layers.0.mlp.down_proj.weight"):
        load_policy(str(path))
