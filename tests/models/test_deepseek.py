"""The DeepSeek-V3 family in lathe's decoder against transformers' `DeepseekV3ForCausalLM` (float64): config reading
and refusals, logits of ragged batches (padded and packed) with and without the low-rank q, interleaved RoPE, YaRN's
mscale and v narrower or wider than q/k, gradients of every parameter, the group-limited router, the critic head,
checkpoints both ways under the checkpoints' names (per-expert tensors, the selection bias). The router computes in
float32 on both sides (as transformers does), so float64 results agree to float32's rounding of the routing weights."""

import pytest
import torch

from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.deepseek import DeepseekMoeBlock, MlaAttention
from lathe.models.hf import lathe_from_transformers

from helpers import assert_close_rel

from .deepseek_tiny import deepseek_config, deepseek_model
from .moe_reference import assert_gradients_equal_transformers, assert_logits_equal_transformers, round_trip

# q_proj instead of the low-rank q, the plain (half-split) RoPE layout, no YaRN, v wider than q/k, no group limit
PLAIN = dict(q_lora_rank=None, rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
             v_head_dim=24, n_group=1, topk_group=1, n_shared_experts=2, norm_topk_prob=False)


@pytest.fixture(scope="module")
def pair():
    hf = deepseek_model(dtype=torch.float64)
    return hf, lathe_from_transformers(hf).eval()


def _hf_dict(**overrides) -> dict:
    d = deepseek_config(**overrides).to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    return d


def test_config_reads_the_deepseek_shape():
    cfg = LatheConfig.from_hf_dict(_hf_dict())
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.v_head_dim, cfg.head_dim) == (24, 16, 20, 10, 24)
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4
    assert [cfg.is_sparse_layer(i) for i in range(3)] == [False, True, True]
    moe = cfg.moe
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor, moe.num_experts, moe.scoring) == (
        4, 2, 2.5, 8, "sigmoid")
    mscale = 0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1
    assert m.softmax_scale == pytest.approx(20 ** -0.5 * mscale ** 2)
    assert LatheConfig.from_hf_dict(_hf_dict(**PLAIN)).head_dim == 24


def test_config_reads_a_hub_layout():
    """Moonlight-16B-A3B's config.json keys (transformers 4 layout: rope_theta, scoring_func, topk_method)."""
    d = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 2048,
         "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
         "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
         "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 512,
         "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
         "routed_scaling_factor": 2.446, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
         "rope_theta": 50000.0, "rope_scaling": None, "vocab_size": 163840, "max_position_embeddings": 8192,
         "num_nextn_predict_layers": 0, "tie_word_embeddings": False}
    cfg = LatheConfig.from_hf_dict(d)
    assert cfg.head_dim == 192 and cfg.mla.q_lora_rank is None and cfg.rope.rope_theta == 50000.0
    assert cfg.mla.softmax_scale == pytest.approx(192 ** -0.5)


def test_config_refuses_what_the_decoder_lacks():
    with pytest.raises(UnsupportedArchitecture, match="quant_method='awq'"):    # (block FP8: tests/models/test_quantized.py)
        LatheConfig.from_hf_dict({**_hf_dict(), "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(UnsupportedArchitecture, match="scoring_func='softmax'"):
        LatheConfig.from_hf_dict({**_hf_dict(), "scoring_func": "softmax"})
    with pytest.raises(UnsupportedArchitecture, match="num_key_value_heads=2"):
        LatheConfig.from_hf_dict({**_hf_dict(), "num_key_value_heads": 2})


@pytest.mark.parametrize("variant", ["lora-q yarn interleaved", "plain"])
def test_logits_equal_transformers(pair, variant):
    hf, lathe = pair if variant != "plain" else (None, None)
    if hf is None:
        hf = deepseek_model(seed=3, dtype=torch.float64, **PLAIN)
        lathe = lathe_from_transformers(hf).eval()
    assert isinstance(lathe.model.layers[1].mlp, DeepseekMoeBlock)
    assert isinstance(lathe.model.layers[0].self_attn, MlaAttention)
    assert_logits_equal_transformers(hf, lathe, rel=1e-6)    # the router's float32 rounds (transformers' too)


def test_gradients_equal_transformers(pair):
    assert_gradients_equal_transformers(*pair, ("model.layers.1.self_attn.q_a_layernorm.weight",
                                                "model.layers.2.mlp.gate.weight",
                                                "model.layers.2.mlp.shared_experts.down_proj.weight",
                                                "model.layers.0.self_attn.kv_b_proj.weight"))


def test_router_limits_groups_and_uses_the_bias_for_selection_only(pair):
    """Every token's experts lie in its topk_group best groups (ranked by the biased scores); the weights are the
    unbiased sigmoid scores, renormalised and scaled, as transformers' router gives them."""
    hf, lathe = pair
    block = lathe.model.layers[1].mlp
    x = torch.randn(30, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, ref_w, ref_idx = hf.model.layers[1].mlp.gate(x)
    from lathe.models.deepseek import group_limited_route
    scores = torch.sigmoid(x.float() @ block.gate.weight.float().T)      # float32, as the block computes it
    w, idx = group_limited_route(scores, block.gate.e_score_correction_bias, 3, 4, 2, True, 2.5)
    order, ref_order = idx.sort(-1), ref_idx.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    assert_close_rel(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices), rel=1e-12, name="weights")
    assert all(len(set(r)) <= 2 for r in (idx // 2).tolist())        # groups of 2 experts, top-2 groups
    unbiased = scores.topk(3).indices.sort(-1).values
    assert not torch.equal(unbiased, order.values)          # the bias (and the group limit) changed some choices


def test_value_model_equals_transformers_token_classification():
    from transformers import DeepseekV3ForTokenClassification
    torch.manual_seed(0)
    cfg = deepseek_config(num_labels=1)
    cfg._experts_implementation = "eager"
    hf = DeepseekV3ForTokenClassification(cfg).eval()
    value = lathe_from_transformers(hf)
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        assert_close_rel(value(ids).logits, hf(ids).logits, name="values")


def test_checkpoint_round_trip_through_transformers(tmp_path):
    deepseek_model(seed=1).save_pretrained(tmp_path / "hf")
    names, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", 101, experts_implementation="eager")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())                    # per-expert tensors and the bias, under the same names
    assert {"model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= names
    assert arch == "DeepseekV3ForCausalLM"


def test_mtp_layers_are_dropped_and_the_selection_bias_stays_float32(tmp_path):
    """DeepSeek-V3's checkpoints carry an MTP layer after the last decoder layer; lathe (like transformers) does not
    run it and loads the rest. The expert-selection bias is read, and kept through casts, in float32."""
    from safetensors.torch import load_file, save_file

    from lathe.models import load_lathe_model
    deepseek_model(seed=1).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state.update({"model.layers.3.eh_proj.weight": torch.zeros(32, 64),
                  "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(88, 16)})
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_lathe_model(tmp_path, torch.bfloat16)
    assert len(model.model.layers) == 3
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, state["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    model.to(torch.float16)
    assert model.model.layers[2].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_training_tensor_parallel_refuses_the_latent_attention(pair):
    from lathe.train.tensor_parallel import check_model
    key = "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size"
    with pytest.raises(ValueError, match=f"{key}=2: the latent attention of DeepseekV3ForCausalLM"):
        check_model(pair[1], 2, key)
