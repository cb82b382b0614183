"""`run_check`: agreement with transformers on a good checkpoint, failure on a corrupted one, fallback notice."""

import json

import torch

from lathe.models.check import run_check

from .lathe_tiny import FAMILIES, save_hf


def test_good_checkpoints_pass(tmp_path):
    for family in FAMILIES:
        path, _ = save_hf(tmp_path, family, tie=family == "qwen3")
        lines = []
        assert run_check(path, num_batches=2, out=lines.append) == 0, "\n".join(lines)
        text = "\n".join(lines)
        assert "lathe will use: lathe decoder" in text and "max |logit diff|" in text


def test_a_corrupted_weight_is_caught(tmp_path, monkeypatch):
    import lathe.models.check as check
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
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    lines = []
    assert run_check(tmp_path, out=lines.append) == 0
    assert "transformers fallback" in "\n".join(lines) and "GPT2LMHeadModel" in "\n".join(lines)
