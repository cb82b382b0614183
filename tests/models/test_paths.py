"""lathe.models.paths: a model or tokenizer path that cannot load is refused before anything loads, naming the key."""

from __future__ import annotations

import json

import pytest

from lathe.models.paths import ModelLoadError, check_model, check_tokenizer, resolve

KEY = "actor_rollout_ref.model.path"


def test_a_checkpoint_directory_and_the_builtin_model_pass(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    check_model(str(tmp_path), KEY)
    check_model("builtin:tiny", KEY)
    check_tokenizer("builtin:anything", "actor_rollout_ref.model.tokenizer_path")   # any builtin: the built-in one


@pytest.mark.parametrize("path, match", [
    ("/no/such/model", r"actor_rollout_ref.model.path='/no/such/model': no such directory. Fix: .*builtin:tiny"),
    ("builtin:huge", r"actor_rollout_ref.model.path: unknown built-in model 'builtin:huge'; known: builtin:tiny"),
    ("", r"actor_rollout_ref.model.path is empty. Fix:"),
])
def test_a_path_that_names_nothing_is_refused_with_the_key(path, match):
    with pytest.raises(ModelLoadError, match=match):
        check_model(path, KEY)


def test_a_file_or_a_directory_without_config_json_is_not_a_checkpoint(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"is a file; it must be a directory holding config.json"):
        check_model(str(weights), KEY)
    with pytest.raises(ModelLoadError, match=rf"{KEY}='{tmp_path}' has no config.json.*global_step_N/actor/huggingface"):
        check_model(str(tmp_path), KEY)
    hf = tmp_path / "actor" / "huggingface"          # a lathe checkpoint's step directory: the fix names its model
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=rf"Fix: use {hf} "):
        check_model(str(tmp_path), KEY)
    with pytest.raises(ModelLoadError, match=r"tokenizer_path=.*: the directory has no tokenizer files"):
        check_tokenizer(str(tmp_path), "actor_rollout_ref.model.tokenizer_path")  # transformers would make an empty one
    (tmp_path / "tokenizer_config.json").write_text("{}")
    check_tokenizer(str(tmp_path), "actor_rollout_ref.model.tokenizer_path")    # a tokenizer directory


def test_a_hub_id_is_left_to_the_loader_online_and_checked_in_the_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants
    check_model("Qwen/Qwen2.5-0.5B-Instruct", KEY)                  # online: the loader downloads it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)         # (read once, when huggingface_hub is imported)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    for check in (check_model, check_tokenizer):
        with pytest.raises(ModelLoadError, match=r"'Qwen/Qwen2.5-0.5B-Instruct' is not a local directory.*offline "
                                                 r"\(HF_HUB_OFFLINE=1\).*Fix: .*hf download"):
            check("Qwen/Qwen2.5-0.5B-Instruct", KEY)
    snapshot = tmp_path / "models--Qwen--Qwen2.5-0.5B-Instruct"     # a cached copy: offline loads it
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("abc")
    (snapshot / "snapshots" / "abc").mkdir(parents=True)
    (snapshot / "snapshots" / "abc" / "config.json").write_text("{}")
    check_model("Qwen/Qwen2.5-0.5B-Instruct", KEY)


def test_resolve_gives_the_directory_or_the_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("~") == str(tmp_path)
    assert resolve("org/name") == "org/name"
    with pytest.raises(ModelLoadError, match=r"model path 'a/b/c': no such directory"):
        resolve("a/b/c")
