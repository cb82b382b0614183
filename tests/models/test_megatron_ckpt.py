"""lathe.models.megatron_ckpt: a Megatron-Core torch_dist checkpoint (written by the test from Megatron's layout rules,
`megatron_writer.py`) loads into lathe's decoder with the weights and logits of the transformers model it came from,
in each layout Megatron saves (stacked or numbered layers; stacked, numbered or TE-numbered experts; a padded
vocabulary); what lathe cannot read fails naming the path or the tensor."""

from __future__ import annotations

import io
import json

import pytest
import torch

from lathe.models.megatron_ckpt import MegatronCheckpointError, check_dist_checkpoint
from lathe.models import load_lathe_model
from lathe.models.hf import load_policy
from lathe.models.paths import ModelLoadError

from helpers import assert_close_rel
from .megatron_writer import megatron_state, save_megatron
from .deepseek_tiny import deepseek_model
from .lathe_tiny import MOE, hf_model, ragged_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*single process:UserWarning")   # dcp on one process: meant
CASES = {   # name: (model builder, layout)
    "qwen2 stacked layers, padded vocab": (lambda: hf_model("qwen2"), dict(stacked=True, pad_vocab_to=128)),
    "qwen3 q/k norms, tied": (lambda: hf_model("qwen3", tie=True), dict()),
    "llama numbered layers": (lambda: hf_model("llama"), dict()),
    "qwen3-moe stacked layers and experts": (lambda: _all_sparse_moe(), dict(stacked=True, experts="stacked")),
    "qwen3-moe dense layer 0, stacked layers whose chunks cover some": (lambda: hf_model(MOE, seed=4),
                                                                       dict(stacked=True)),
    "qwen3-moe dense layer 0, numbered experts split gate/up": (lambda: hf_model(MOE, seed=2),
                                                                  dict(experts="numbered")),
    "deepseek-v3 MLA, shared experts, TE experts": (lambda: deepseek_model(seed=1), dict(experts="te")),
    "deepseek-v3 plain q": (lambda: deepseek_model(seed=2, q_lora_rank=None), dict(pad_vocab_to=104)),
}


def _all_sparse_moe():
    from transformers import AutoModelForCausalLM

    from .lathe_tiny import hf_config
    torch.manual_seed(3)
    cfg = hf_config(MOE)
    cfg.mlp_only_layers = []
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _saved(tmp_path, case):
    build, layout = CASES[case]
    hf = build()
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf", save_megatron(hf, tmp_path / "mcore", **layout)


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_checkpoint_loads_the_weights_and_logits_of_the_model(tmp_path, case):
    hf, hf_dir, mcore = _saved(tmp_path, case)
    from_mcore = load_lathe_model(hf_dir, dist_checkpoint=mcore).eval()
    from_hf = load_lathe_model(hf_dir).eval()
    expected = from_hf.state_dict()
    got = from_mcore.state_dict()
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    ids, mask, pos = ragged_batch(0)
    real = mask.bool()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = from_mcore(ids, mask, pos).logits
    assert_close_rel(out[real], ref[real], rel=1e-5, name="logits")


def test_the_policy_loads_from_the_checkpoint_and_refuses_the_transformers_paths(tmp_path):
    hf, hf_dir, mcore = _saved(tmp_path, "qwen2 stacked layers, padded vocab")
    policy = load_policy(str(hf_dir), dist_checkpoint=str(mcore))
    assert torch.equal(policy.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    with pytest.raises(ModelLoadError, match="actor_rollout_ref.model.impl=hf"):
        load_policy(str(hf_dir), impl="hf", dist_checkpoint=str(mcore))
    with pytest.raises(ModelLoadError, match=r"dist_checkpointing_path=.*missing.*no such directory"):
        load_policy(str(hf_dir), dist_checkpoint=str(tmp_path / "missing"))


def test_a_key_prefix_is_stripped(tmp_path):
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path / "hf")
    mcore = save_megatron(hf, tmp_path / "mcore", prefix="module.")
    with pytest.raises(MegatronCheckpointError, match="no decoder.* tensors .*dist_checkpointing_prefix"):
        load_lathe_model(tmp_path / "hf", dist_checkpoint=mcore)
    model = load_lathe_model(tmp_path / "hf", dist_checkpoint=mcore, dist_checkpoint_prefix="module.")
    assert torch.equal(model.model.layers[1].self_attn.q_norm.weight, hf.model.layers[1].self_attn.q_norm.weight)


def test_a_missing_or_malformed_directory_fails_naming_the_key_and_path(tmp_path):
    key = "actor_rollout_ref.actor.megatron.dist_checkpointing_path"
    with pytest.raises(MegatronCheckpointError, match=f"{key} is empty"):
        check_dist_checkpoint("", key)
    with pytest.raises(MegatronCheckpointError, match=f"{key}='{tmp_path / 'nope'}': no such directory"):
        check_dist_checkpoint(str(tmp_path / "nope"), key)
    with pytest.raises(MegatronCheckpointError, match="has no metadata.json"):
        check_dist_checkpoint(str(tmp_path), key)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(MegatronCheckpointError, match="sharded_backend='zarr'.*torch_dist"):
        check_dist_checkpoint(str(tmp_path), key)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(MegatronCheckpointError, match="no .metadata"):
        check_dist_checkpoint(str(tmp_path), key)


def test_a_tensor_lathe_cannot_map_fails_naming_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path / "hf")
    state = megatron_state(hf)
    state["decoder.layers.1.self_attention.linear_qkv.layer_norm_bias"] = torch.zeros(32)   # LayerNorm, not RMSNorm
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "mcore")), no_dist=True)
    (tmp_path / "mcore" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    unmapped = r"decoder\.layers\.1\.self_attention\.linear_qkv\.layer_norm_bias has no Hugging Face counterpart"
    with pytest.raises(MegatronCheckpointError, match=unmapped + ".*Qwen3-MoE"):
        load_lathe_model(tmp_path / "hf", dist_checkpoint=tmp_path / "mcore")
    other = {"language_model.decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(2, 2), "x": io.BytesIO(b"")}
    dcp.save(other, storage_writer=dcp.FileSystemWriter(str(tmp_path / "vl")), no_dist=True)
    (tmp_path / "vl" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with pytest.raises(MegatronCheckpointError, match="no decoder.* tensors .*language_model"):
        load_lathe_model(tmp_path / "hf", dist_checkpoint=tmp_path / "vl")
