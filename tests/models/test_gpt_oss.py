"""GPT-OSS in lathe's decoder against transformers' `GptOssForCausalLM`: config reading and refusals, logits (padded
and packed ragged batches longer than the sliding window), gradients and the load-balancing loss, checkpoints both
ways (the experts fused on disk, as transformers writes them)."""

import pytest
import torch

from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.gpt_oss import GptOssMoeBlock, clamped_swiglu
from lathe.models.hf import lathe_from_transformers
from lathe.models.moe import router_aux_loss_coef

from helpers import assert_close_rel

from .gpt_oss_tiny import gpt_oss_config, gpt_oss_model
from .moe_reference import assert_logits_equal_transformers, aux_and_gradients, round_trip


@pytest.fixture(scope="module")
def pair():
    hf = gpt_oss_model()
    return hf, lathe_from_transformers(hf).eval()


def _hf_dict(**overrides) -> dict:
    d = gpt_oss_config(**overrides).to_dict()
    d["architectures"] = ["GptOssForCausalLM"]
    return d


def test_config_reads_the_gpt_oss_shape():
    cfg = LatheConfig.from_hf_dict(_hf_dict())
    assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.moe.fused_on_disk
    assert (cfg.window_of(0), cfg.window_of(1)) == (4, None)
    assert cfg.moe.num_experts == 4 and cfg.moe.moe_intermediate_size == 16 and cfg.moe.swiglu_limit == 0.5
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    assert all(cfg.is_sparse_layer(i) for i in range(2))


def test_config_reads_the_hub_layout():
    """gpt-oss-20b's config.json (transformers 4 layout: rope_theta + rope_scaling), its MXFP4 block removed; without
    any RoPE keys, transformers' defaults."""
    d = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
         "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
         "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
         "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                          "rope_type": "yarn", "truncate": False},
         "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "vocab_size": 201088,
         "layer_types": ["sliding_attention", "full_attention"] * 12}
    cfg = LatheConfig.from_hf_dict(d)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.rope.rope_theta == 150000 and cfg.rope.factor == 32 and cfg.window_of(22) == 128
    bare = LatheConfig.from_hf_dict({k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")})
    assert bare.rope == cfg.rope


def test_value_model_equals_transformers_token_classification():
    from transformers import GptOssForTokenClassification
    torch.manual_seed(0)
    hf = GptOssForTokenClassification(gpt_oss_config(num_labels=1)).eval()
    value = lathe_from_transformers(hf)
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        assert_close_rel(value(ids).logits, hf(ids).logits, name="values")


def test_config_refuses_what_the_decoder_lacks():
    d = _hf_dict()
    d["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(UnsupportedArchitecture, match=r"mxfp4.*Mxfp4Config\(dequantize=True\)"):
        LatheConfig.from_hf_dict(d)
    with pytest.raises(UnsupportedArchitecture, match="layer_types"):
        LatheConfig.from_hf_dict(_hf_dict(layer_types=["chunked_attention", "full_attention"]))


def test_padded_and_packed_logits_equal_transformers(pair):
    hf, lathe = pair
    assert all(isinstance(layer.mlp, GptOssMoeBlock) for layer in lathe.model.layers)
    assert_logits_equal_transformers(hf, lathe)                 # ragged rows of up to 20 tokens


def test_the_clamps_act_on_this_model(pair):
    _, lathe = pair
    layer = lathe.model.layers[0]
    x = layer.post_attention_layernorm(lathe.model.embed_tokens(torch.arange(50)))
    h = x @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
    assert (h.abs() > 0.5).any()              # the limit clips some of the tiny model's activations
    assert not torch.allclose(clamped_swiglu(h, 1.702, 0.5), clamped_swiglu(h, 1.702, 1e9))


def test_aux_loss_and_gradients_equal_transformers(pair):
    hf, lathe = pair
    stats, aux, ref_aux, grads, ref, tokens = aux_and_gradients(hf, lathe)
    assert stats.rows == 2 * tokens                      # two sparse layers, the real tokens only
    assert_close_rel(aux, ref_aux, name="load-balancing loss")
    assert set(ref) == set(grads) == {n for n, _ in hf.named_parameters()}
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.router.bias",
                 "model.layers.0.mlp.experts.gate_up_proj_bias"):
        assert grads[name].abs().sum() > 0, name
    assert_close_rel(grads, ref, rel=1e-4, name="gradients")


def test_aux_loss_weight_follows_output_router_logits():
    assert router_aux_loss_coef(lathe_from_transformers(gpt_oss_model())) == 0.0
    hf = gpt_oss_model(output_router_logits=True, router_aux_loss_coef=0.25)
    assert router_aux_loss_coef(lathe_from_transformers(hf)) == 0.25


def test_checkpoint_round_trip_through_transformers(tmp_path):
    from safetensors import safe_open
    gpt_oss_model(seed=1).save_pretrained(tmp_path / "hf")
    names, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", 101, attn_implementation="eager")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())                    # the experts fused on disk, under the same names
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.0.self_attn.sinks" in names
    assert arch == "GptOssForCausalLM"


def test_ulysses_and_the_grouped_forward_take_these_layers(pair):
    """Ulysses splits the sinks' and windows' layers (tests/train/test_ulysses_hybrid.py), and the prefix-grouped
    forward's attention applies them: one segment of 7 tokens (past the 4-token window) is the packed forward of the
    same tokens (a grouped batch against the per-row forward: tests/train/test_prefix_group.py)."""
    from lathe.train.ulysses import check_model
    _, lathe = pair
    check_model(lathe, 2, "actor_rollout_ref.actor.ulysses_sequence_parallel_size")
    from .test_hybrid import _one_segment
    ids = torch.arange(3, 10)
    grouped = lathe.hidden_grouped(ids, torch.arange(7), _one_segment(7))
    packed = lathe.hidden_packed(ids, torch.arange(7), torch.tensor([0, 7], dtype=torch.int32), 7)
    assert_close_rel(grouped, packed)


def test_sink_attention_in_query_slices_equals_whole():
    """Slices of the queries (recomputed in backward) give the whole computation's output and gradients."""
    from lathe.models.attention import sink_attention, window_mask
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 13, 8, generator=gen, requires_grad=True) for heads in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, requires_grad=True)
    mask = window_mask(torch.arange(13), torch.arange(13), 5)
    results = []
    for max_elements in (1 << 27, 2 * 4 * 13 * 3):         # whole; slices of 3 queries
        out = sink_attention(q, k, v, mask, sinks, max_elements=max_elements)
        results.append([out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v, sinks))])
    for a, b in zip(*results):
        assert_close_rel(a, b, name="sliced sink attention")
