"""Tests for lathe.models.hf: loading local checkpoints, error messages, the built-in model."""

import pytest
import torch

from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import (BUILTIN_SHAPES, ModelLoadError, build_builtin_model, is_builtin, load_causal_lm,
                             load_tokenizer)


def _tiny_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, Qwen2Config
    cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    return cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
               tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)


def _save_checkpoint(tmp_path, arch: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    model = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}[arch](_tiny_config(arch, len(tok))).eval()
    path = tmp_path / arch
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model, tok


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_local_checkpoint_loads_with_identical_logits(tmp_path, arch):
    path, model, tok = _save_checkpoint(tmp_path, arch)
    loaded = load_causal_lm(str(path)).eval()
    assert type(loaded) is type(model)
    assert next(loaded.parameters()).dtype == torch.float32
    loaded_tok = load_tokenizer(str(path))
    text = "12+7=19"
    ids = loaded_tok.encode(text)
    assert ids == tok.encode(text) and loaded_tok.decode(ids) == text
    assert loaded_tok.pad_token_id == tok.pad_token_id and loaded_tok.eos_token_id == tok.eos_token_id
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_local_checkpoint_dtype_and_override_config(tmp_path):
    path, _, _ = _save_checkpoint(tmp_path, "qwen2")
    model = load_causal_lm(str(path), dtype=torch.bfloat16, override_config={"attention_dropout": 0.25})
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config.attention_dropout == 0.25


def test_tokenizer_without_pad_gets_eos_as_pad(tmp_path):
    tok = builtin_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id


def test_missing_directory_explains_the_choices(tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ModelLoadError, match="no such directory") as err:
            load(str(missing))
        assert str(missing) in str(err.value) and "builtin:tiny" in str(err.value)


def test_file_path_is_rejected(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(ModelLoadError, match="is a file; it must be a directory"):
            load(str(f))


@pytest.mark.parametrize("path", ["not a model", "just-a-name", "a/b/c"])
def test_non_hub_id_string_is_rejected(path):
    with pytest.raises(ModelLoadError, match="no such directory") as err:
        load_causal_lm(path)
    assert "hub id" in str(err.value)


def test_directory_without_weights_names_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="could not load the model") as err:
        load_causal_lm(str(tmp_path / "empty"))
    assert "HF_HUB_OFFLINE" not in str(err.value)    # a local directory: no hub advice


def test_hub_id_offline_says_use_a_local_directory(monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # read once at import time
    for load, what in ((load_causal_lm, "model"), (load_tokenizer, "tokenizer")):
        with pytest.raises(ModelLoadError) as err:
            load("lathe-tests/no-such-model-xyz")
        msg = str(err.value)
        assert f"could not load the {what} from 'lathe-tests/no-such-model-xyz'" in msg
        assert "offline" in msg and "local directory" in msg


def test_builtin_prefix():
    assert is_builtin("builtin:tiny") and not is_builtin("Qwen/Qwen2.5-0.5B") and not is_builtin(None)


def test_builtin_unknown_shape_lists_known_ones():
    with pytest.raises(ModelLoadError, match="unknown built-in model 'builtin:huge'") as err:
        load_causal_lm("builtin:huge")
    assert all(f"builtin:{s}" in str(err.value) for s in BUILTIN_SHAPES)


def test_builtin_model_is_seeded_and_leaves_global_rng():
    tok = builtin_tokenizer()
    state = torch.get_rng_state()
    a = build_builtin_model("tiny", vocab_size=len(tok), seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    b = load_causal_lm("builtin:tiny", vocab_size=len(tok), seed=0)
    c = build_builtin_model("tiny", vocab_size=len(tok), seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id
    assert a.config.hidden_size == BUILTIN_SHAPES["tiny"]["hidden_size"]
    assert build_builtin_model("tiny", vocab_size=50, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


def test_builtin_tokenizer_via_load_tokenizer():
    tok = load_tokenizer("builtin:tiny")
    assert tok.decode(tok.encode("3*4=12")) == "3*4=12"


def test_custom_chat_template_replaces_a_missing_one_and_the_dataset_renders_with_it(tmp_path):
    """What data/dataset.py's "no chat template" error tells users to set really works."""
    import json

    from lathe.data import RLDataset
    from lathe.data.errors import DataError
    bare = builtin_tokenizer()
    bare.chat_template = None
    bare.save_pretrained(tmp_path / "base")
    row = {"data_source": "x", "prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"}}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match="custom_chat_template"):
        RLDataset(str(data), load_tokenizer(str(tmp_path / "base")))
    template = "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
    tok = load_tokenizer(str(tmp_path / "base"), chat_template=template)
    assert tok.decode(RLDataset(str(data), tok)[0]["prompt_ids"]) == "Q: 1+1= A:"
    assert load_tokenizer("builtin:tiny", chat_template=template).chat_template == template


def test_external_lib_is_imported_and_a_failure_names_the_key(tmp_path, monkeypatch):
    import sys

    from lathe.models.hf import import_external_libs
    (tmp_path / "my_models_pkg.py").write_text("REGISTERED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_external_libs({"actor_rollout_ref.model.external_lib": "my_models_pkg", "critic.model.external_lib": None})
    assert sys.modules["my_models_pkg"].REGISTERED
    with pytest.raises(ModelLoadError, match=r"critic\.model\.external_lib='no_such_pkg_x'.*no_such_pkg_x.*PYTHONPATH"):
        import_external_libs({"critic.model.external_lib": "no_such_pkg_x"})


def _fake_hub(tmp_path, monkeypatch, repo: str, source) -> None:
    """An offline hub cache holding `source` (a checkpoint directory) as hub id `repo`."""
    import shutil

    import huggingface_hub.constants

    from lathe.models import hf
    cached = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, cached / "snapshots" / "abc")
    (cached / "refs").mkdir()
    (cached / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)     # (read once at import time)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hf.checkpoint_config_dir.cache_clear()


def test_a_hub_id_lathe_runs_loads_straight_from_the_cache_into_its_decoder(tmp_path, monkeypatch):
    """verl's scripts name models by hub id (`Qwen/Qwen3-8B`): lathe's decoder reads the cached snapshot's safetensors
    directly (no transformers copy of the weights on the host first), as it reads a local directory; an id whose
    repository holds no safetensors goes to transformers as before."""
    from lathe.models import hf
    from lathe.models.decoder import LatheCausalLM
    path, model, _ = _save_checkpoint(tmp_path, "qwen2")
    _fake_hub(tmp_path, monkeypatch, "tiny/qwen2", path)
    monkeypatch.setattr(hf, "load_causal_lm", lambda *a, **k: pytest.fail("read through transformers"))
    loaded = hf.load_policy("tiny/qwen2")
    assert isinstance(loaded, LatheCausalLM)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    hf.checkpoint_config_dir.cache_clear()
    for f in (tmp_path / "hub" / "models--tiny--qwen2" / "snapshots" / "abc").glob("*.safetensors"):
        f.unlink()
    assert hf.hub_snapshot("tiny/qwen2") is None
