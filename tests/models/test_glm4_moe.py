"""GLM-4.5 (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6; verl's GLM scripts) in lathe's decoder against
transformers (float64): config reading (a hub layout, transformers' defaults), logits of ragged batches (padded and
packed) with RoPE over part of each head, q/k norms and biases, group-limited sigmoid routing and a shared expert;
gradients of every parameter; checkpoints both ways (per-expert tensors, the selection bias in float32, the MTP layer
dropped); the engine's greedy tokens and log-probs, and a tensor-parallel engine replica against one process."""

import pytest
import torch

from lathe.models import load_lathe_model
from lathe.models.config import LatheConfig
from lathe.models.deepseek import DeepseekMoeBlock
from lathe.models.hf import lathe_from_transformers

from .glm_tiny import VOCAB, glm_config, glm_model
from .moe_reference import assert_critic_round_trip, assert_engine_equals_transformers, \
    assert_gradients_equal_transformers, assert_logits_equal_transformers, assert_round_trip_without_the_mtp_layer, \
    assert_tp_replica_equals_one_process

# no group limit, no q/k norms or biases, RoPE over a quarter of each head, no renormalisation, two shared experts
PLAIN = dict(n_group=1, topk_group=1, use_qk_norm=False, attention_bias=False, norm_topk_prob=False,
             n_shared_experts=2, routed_scaling_factor=1.0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def pair():
    hf = glm_model(dtype=torch.float64)
    return hf, lathe_from_transformers(hf).eval()


def test_config_reads_a_hub_layout():
    """GLM-4.5-Air's config.json keys (transformers 4 layout: rope_theta and partial_rotary_factor at the top)."""
    d = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
         "hidden_size": 4096, "head_dim": 128, "intermediate_size": 10944, "moe_intermediate_size": 1408,
         "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "n_shared_experts": 1,
         "n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
         "norm_topk_prob": True, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 1000000,
         "rope_scaling": None, "max_position_embeddings": 131072, "num_nextn_predict_layers": 1, "use_qk_norm": False,
         "rms_norm_eps": 1e-05, "vocab_size": 151552, "tie_word_embeddings": False, "hidden_act": "silu",
         "attention_dropout": 0.0, "torch_dtype": "bfloat16"}
    cfg = LatheConfig.from_hf_dict(d)
    assert cfg.architecture == "Glm4MoeForCausalLM" and cfg.mla is None and cfg.stacked_mtp_layers
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope.rope_theta) == (128, 64, 1e6)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
    m = cfg.moe
    assert (m.scoring, m.num_experts, m.num_experts_per_tok, m.n_group, m.topk_group, m.n_shared_experts) == (
        "sigmoid", 128, 8, 1, 1, 1)
    assert [cfg.is_sparse_layer(i) for i in (0, 1, 45)] == [False, True, True]
    # transformers' defaults where the keys are missing: RoPE over half of each head, the MoE's keys
    d = {k: v for k, v in d.items() if k not in ("partial_rotary_factor", "n_shared_experts", "first_k_dense_replace")}
    cfg = LatheConfig.from_hf_dict(d)
    assert cfg.rotary_dim == 64 and cfg.moe.n_shared_experts == 1 and cfg.moe.mlp_only_layers == (0,)
    with pytest.raises(ValueError, match="n_routed_experts=128 must split into n_group=3"):
        LatheConfig.from_hf_dict({**d, "n_group": 3})


def test_the_model_type_alone_names_the_family():
    d = {k: v for k, v in glm_config().to_dict().items() if k != "architectures"}
    assert LatheConfig.from_hf_dict(d).architecture == "Glm4MoeForCausalLM"


@pytest.mark.parametrize("variant", ["groups qk-norm bias", "plain"])
def test_logits_equal_transformers(pair, variant):
    hf, lathe = pair
    if variant == "plain":
        hf = glm_model(seed=3, dtype=torch.float64, **PLAIN)
        lathe = lathe_from_transformers(hf).eval()
        assert lathe.config.rotary_dim == 4 and not lathe.config.qk_norm
    assert isinstance(lathe.model.layers[1].mlp, DeepseekMoeBlock)
    assert not isinstance(lathe.model.layers[0].mlp, DeepseekMoeBlock)
    assert_logits_equal_transformers(hf, lathe, rel=1e-6)    # the router's float32 rounds (transformers' too)


def test_gradients_equal_transformers(pair):
    assert_gradients_equal_transformers(*pair, ("model.layers.1.self_attn.q_norm.weight",
                                                "model.layers.2.mlp.gate.weight",
                                                "model.layers.2.mlp.shared_experts.down_proj.weight",
                                                "model.layers.0.self_attn.k_proj.bias"))


def test_checkpoint_round_trip_and_the_mtp_layer_is_dropped(tmp_path):
    """transformers' save (plus an MTP layer at model.layers.3, as GLM-4.5's checkpoints hold one) loads into lathe
    with the selection bias in float32; lathe's save holds the same tensors but the MTP layer's, and transformers
    loads it to the same logits."""
    assert_round_trip_without_the_mtp_layer(
        glm_model(seed=1), tmp_path, VOCAB, "Glm4MoeForCausalLM", "shared_experts", "mlp.gate.e_score_correction_bias",
        {"model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
         "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.0.self_attn.q_proj.bias"})


def test_a_critic_loads_from_the_policy_checkpoint_and_reads_its_own_save_back(tmp_path):
    """transformers has no GLM-4.5 token-classification class: lathe's value model loads the causal LM's backbone
    (its head at zero) and reads back the critic it saves (`Glm4MoeForTokenClassification`, lathe's name)."""
    assert_critic_round_trip(glm_model(seed=6), tmp_path, VOCAB, "Glm4MoeForTokenClassification")


def test_engine_greedy_equals_transformers_and_its_log_probs_the_forward(tmp_path):
    hf = glm_model(seed=2)
    hf.save_pretrained(tmp_path)
    assert_engine_equals_transformers(hf, load_lathe_model(tmp_path).eval(), tmp_path)


def test_a_tensor_parallel_engine_replica_generates_what_one_process_generates(tmp_path):
    """Over 2 gloo ranks (heads, the dense MLP and the shared experts cut, the experts placed over the ranks, q/k norms
    and the partial RoPE per head): greedy, sampled, and greedy after new weights, as one process."""
    assert_tp_replica_equals_one_process(glm_model(seed=4), tmp_path)


def test_an_adapter_on_the_shared_experts_says_that_peft_would_load_it_elsewhere(pair, tmp_path, caplog):
    """PEFT 0.21 under transformers 5 re-targets gate/up/down_proj adapters of GLM-4.5 to the routed experts
    (huggingface/peft#3711): lathe's save says so where the adapter has such layers (its shared experts, its dense
    first layer), and not for attention-only adapters."""
    import copy
    import logging
    pytest.importorskip("peft")
    from lathe.models import lora
    _, base = pair
    for targets, warned in ((["q_proj", "o_proj"], False), ("all-linear", True)):
        model = copy.deepcopy(base)
        lora.apply_lora(model, rank=2, alpha=4, target_modules=targets)
        lora._warn_peft_retargets.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lathe"):
            lora.save_adapter(model, tmp_path / str(warned))
        said = [r.getMessage() for r in caplog.records if "peft#3711" in r.getMessage()]
        assert bool(said) is warned
        if warned:
            assert "glm4_moe layers named down_proj, gate_proj, up_proj" in said[0]
