"""Checkpoint I/O: lathe reads what transformers writes (one file or shards) and writes what it reads."""

import json

import pytest
import torch

from lathe.models import UnsupportedArchitecture, load_lathe_model, load_lathe_value_model
from lathe.models.io import SAFE_INDEX, parse_size, read_state_dict, save_pretrained
from lathe.models.packing import pack_padded

from helpers import assert_close_rel

from .lathe_tiny import FAMILIES, ragged_batch, save_hf


def _logits(model, batch):
    ids, mask, pos = batch
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits, mask.bool()


def test_lathe_reads_a_sharded_transformers_checkpoint(tmp_path):
    path, hf = save_hf(tmp_path, "llama", max_shard_size="50KB")
    assert (path / SAFE_INDEX).is_file() and len(list(path.glob("model-*.safetensors"))) > 1
    ref, real = _logits(hf, ragged_batch(0))
    out, _ = _logits(load_lathe_model(path), ragged_batch(0))
    assert_close_rel(out[real], ref[real], name="logits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("shard", [None, "50KB"])
def test_saved_checkpoint_loads_back_in_transformers(tmp_path, family, tie, shard):
    from transformers import AutoModelForCausalLM
    src, hf = save_hf(tmp_path, family, tie=tie)
    lathe = load_lathe_model(src)
    with torch.no_grad():   # change the weights so the round trip cannot pass by re-reading the source
        lathe.model.norm.weight.mul_(1.5)
    out = tmp_path / "saved"
    kwargs = {"max_shard_size": shard} if shard else {}
    lathe.save_pretrained(out, **kwargs)
    assert (out / SAFE_INDEX).is_file() == bool(shard)
    assert ("lm_head.weight" in read_state_dict(out)) == (not tie)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    assert back.config.tie_word_embeddings == tie
    ref, real = _logits(back, ragged_batch(1))
    ours, _ = _logits(lathe, ragged_batch(1))
    orig, _ = _logits(hf, ragged_batch(1))
    assert_close_rel(ours[real], ref[real], name="logits")
    assert (orig - ref)[real].abs().max() > 1e-3


def test_saving_single_file_over_shards_removes_stale_files(tmp_path):
    src, _ = save_hf(tmp_path, "qwen2")
    model = load_lathe_model(src)
    out = tmp_path / "out"
    model.save_pretrained(out, max_shard_size="50KB")
    model.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_bf16_save_writes_bf16_and_its_dtype(tmp_path):
    src, _ = save_hf(tmp_path, "qwen3")
    load_lathe_model(src, torch.bfloat16).save_pretrained(tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in read_state_dict(tmp_path / "bf16").values())


def test_unexpected_tensors_mean_an_unsupported_variant(tmp_path):
    src, _ = save_hf(tmp_path, "qwen2")
    model = load_lathe_model(src)
    state = model.state_dict()
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    state["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match="extra.weight.*transformers fallback"):
        load_lathe_model(src)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["PhiForCausalLM"], "model_type": "phi"}))
    with pytest.raises(UnsupportedArchitecture, match="PhiForCausalLM.*transformers fallback"):
        load_lathe_model(tmp_path)


def test_parse_size_uses_transformers_units():
    assert parse_size("50KB") == 50_000 and parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_value_model_from_a_causal_lm_starts_at_zero_and_round_trips_through_transformers(tmp_path):
    from transformers import AutoModelForTokenClassification
    src, _ = save_hf(tmp_path, "qwen2", tie=True)
    critic = load_lathe_value_model(src).eval()
    ids, mask, pos = ragged_batch(2)
    with torch.no_grad():
        assert critic(input_ids=ids, attention_mask=mask, position_ids=pos).logits.eq(0).all()
        critic.score.weight.normal_()
        critic.score.bias.fill_(0.3)
        values = critic(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert values.shape == (*ids.shape, 1)
    save_pretrained(critic, tmp_path / "critic", max_shard_size="50KB")
    hf = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForTokenClassification" and hf.config.num_labels == 1
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert_close_rel(values[mask.bool()], ref[mask.bool()], name="values")
    again = load_lathe_value_model(tmp_path / "critic")
    assert torch.equal(again.score.weight, critic.score.weight) and torch.equal(again.score.bias, critic.score.bias)
    p = pack_padded(ids, mask, pos)
    with torch.no_grad():
        packed = again.forward_packed(p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen)
    assert_close_rel(packed, values[mask.bool()].squeeze(-1), name="packed values")
