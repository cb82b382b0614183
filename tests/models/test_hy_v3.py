"""HY-V3 (`HYV3ForCausalLM`: Tencent's Hy3; verl's `run_hy_v3_megatron.sh`) in lathe's decoder against transformers
(float64): config reading (transformers' layout and defaults, `mlp_layer_types`), logits of ragged batches (padded and
packed) with q/k norms, sigmoid routing with a selection bias and router_scaling_factor, and shared experts; gradients
of every parameter; checkpoints both ways (the hub's names: `mlp.router.gate`, `mlp.expert_bias` kept in float32,
`mlp.shared_mlp`, per-expert tensors; the MTP layer dropped); a critic; the engine's greedy tokens and log-probs, and a
tensor-parallel engine replica against one process."""

import pytest
import torch

from lathe.models import load_lathe_model
from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.deepseek import DeepseekMoeBlock
from lathe.models.hf import lathe_from_transformers

from .hy_tiny import VOCAB, hy_config, hy_model
from .moe_reference import assert_critic_round_trip, assert_engine_equals_transformers, \
    assert_gradients_equal_transformers, assert_logits_equal_transformers, assert_round_trip_without_the_mtp_layer, \
    assert_tp_replica_equals_one_process

# attention biases, the layers' kinds reordered (a dense layer between sparse ones), two shared experts, the plain
# bfloat16 combine
VARIANT = dict(attention_bias=True, mlp_layer_types=["sparse", "dense", "sparse"], num_shared_experts=2,
               router_scaling_factor=1.0, enable_moe_fp32_combine=False)


@pytest.fixture(scope="module")
def pair():
    hf = hy_model(dtype=torch.float64)
    return hf, lathe_from_transformers(hf).eval()


def test_config_reads_transformers_layout_and_defaults():
    d = {**hy_config().to_dict(), "architectures": ["HYV3ForCausalLM"]}
    cfg = LatheConfig.from_hf_dict(d)
    assert cfg.architecture == "HYV3ForCausalLM" and cfg.mla is None and cfg.stacked_mtp_layers
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias and cfg.rotary_dim == cfg.head_dim == 16
    m = cfg.moe
    assert (m.scoring, m.num_experts, m.num_experts_per_tok, m.n_group, m.norm_topk_prob, m.n_shared_experts) == (
        "sigmoid", 8, 3, 1, True, 1)
    assert m.routed_scaling_factor == pytest.approx(2.826) and m.mlp_only_layers == (0,)
    # Hy3's shape from transformers' defaults where config.json leaves keys out (its RoPE base among them)
    cfg = LatheConfig.from_hf_dict({"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3"})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (4096, 80, 128, 8)
    assert (cfg.moe.num_experts, cfg.moe.moe_intermediate_size, cfg.rope.rope_theta) == (192, 1536, 11158840.0)
    assert [cfg.is_sparse_layer(i) for i in (0, 1, 79)] == [False, True, True]
    assert cfg.hf_config == {"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3"}   # saved back as read
    with pytest.raises(ValueError, match="mlp_layer_types must name each of the 3 layers"):
        LatheConfig.from_hf_dict({**d, "mlp_layer_types": ["dense", "moe", "sparse"]})
    with pytest.raises(UnsupportedArchitecture, match="mlp_bias=true"):
        LatheConfig.from_hf_dict({**d, "mlp_bias": True})


def test_the_model_type_alone_names_the_family():
    d = {k: v for k, v in hy_config().to_dict().items() if k != "architectures"}
    assert LatheConfig.from_hf_dict(d).architecture == "HYV3ForCausalLM"


@pytest.mark.parametrize("variant", ["default", "biases, dense between sparse"])
def test_logits_equal_transformers(pair, variant):
    hf, lathe = pair
    sparse = [1, 2]
    if variant != "default":
        hf = hy_model(seed=3, dtype=torch.float64, **VARIANT)
        lathe = lathe_from_transformers(hf).eval()
        assert lathe.config.qkv_bias and lathe.config.o_bias and lathe.config.moe.n_shared_experts == 2
        sparse = [0, 2]
    assert [isinstance(layer.mlp, DeepseekMoeBlock) for layer in lathe.model.layers] == [i in sparse for i in range(3)]
    assert_logits_equal_transformers(hf, lathe, rel=1e-6)    # the router's float32 rounds (transformers' too)


def test_gradients_equal_transformers(pair):
    assert_gradients_equal_transformers(*pair, ("model.layers.1.self_attn.q_norm.weight",
                                                "model.layers.2.mlp.gate.weight",
                                                "model.layers.2.mlp.shared_experts.down_proj.weight",
                                                "model.layers.1.mlp.experts.gate_up_proj"))


def test_checkpoint_round_trip_under_the_hub_s_names_and_the_mtp_layer_is_dropped(tmp_path):
    """transformers' save (the hub's names, plus an MTP layer at model.layers.3) loads into lathe with the selection
    bias in float32; lathe's save holds the same tensors under the same names but the MTP layer's, and transformers
    loads it to the same logits."""
    assert_round_trip_without_the_mtp_layer(
        hy_model(seed=1), tmp_path, VOCAB, "HYV3ForCausalLM", "shared_mlp", "mlp.expert_bias",
        {"model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.2.mlp.expert_bias",
         "model.layers.1.mlp.router.gate.weight", "model.layers.1.mlp.shared_mlp.gate_proj.weight"})


def test_a_critic_loads_from_the_policy_checkpoint_and_reads_its_own_save_back(tmp_path):
    """transformers has no HY-V3 token-classification class: lathe's value model loads the causal LM's backbone (its
    head at zero) and reads back the critic it saves (`HYV3ForTokenClassification`, lathe's name, the hub's tensor
    names)."""
    assert_critic_round_trip(hy_model(seed=6), tmp_path, VOCAB, "HYV3ForTokenClassification")


def test_engine_greedy_equals_transformers_and_its_log_probs_the_forward(tmp_path):
    hf = hy_model(seed=2)
    hf.save_pretrained(tmp_path)
    assert_engine_equals_transformers(hf, load_lathe_model(tmp_path).eval(), tmp_path)


def test_a_tensor_parallel_engine_replica_generates_what_one_process_generates(tmp_path):
    """Over 2 gloo ranks (heads, the dense MLP and the shared experts cut, the experts placed over the ranks, q/k
    norms per head): greedy, sampled, and greedy after new weights, as one process."""
    assert_tp_replica_equals_one_process(hy_model(seed=4), tmp_path)
