"""Reading HF config.json: both rope layouts, family switches, and clear refusals."""

import json

import pytest

from lathe.models import SUPPORTED_ARCHITECTURES, UnsupportedArchitecture, supports
from lathe.models.config import LatheConfig

BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def test_registry_names_the_families():
    assert SUPPORTED_ARCHITECTURES == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                       "Qwen3MoeForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
                                       "MiMoForCausalLM", "MistralForCausalLM", "SeedOssForCausalLM",
                                       "Glm4ForCausalLM", "Glm4MoeForCausalLM", "HYV3ForCausalLM", "Qwen3_5ForCausalLM",
                                       "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "NemotronHForCausalLM"}


def test_qwen3_moe_keys():
    moe = {**BASE, "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 4, "norm_topk_prob": True, "mlp_only_layers": [3], "router_aux_loss_coef": 0.01}
    cfg = LatheConfig.from_hf_dict(moe)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm and cfg.moe.norm_topk_prob
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size) == (8, 2, 4)
    assert cfg.moe.router_aux_loss_coef == 0.01 and not cfg.moe.output_router_logits
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [True, True, True, False]
    # transformers 5 writes num_local_experts; decoder_sparse_step makes every other layer sparse
    cfg = LatheConfig.from_hf_dict({k: v for k, v in moe.items() if k != "num_experts"}
                                   | {"num_local_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert cfg.moe.num_experts == 8 and [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    assert LatheConfig.from_hf_dict(BASE | {"model_type": "qwen3"}).moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        LatheConfig.from_hf_dict(moe | {"num_experts_per_tok": 9})


def test_transformers4_layout_with_rope_scaling_and_type_key():
    cfg = LatheConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
                                    "max_position_embeddings": 4096,
                                    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0}})
    assert cfg.rope.rope_type == "llama3" and cfg.rope.rope_theta == 500000.0
    assert cfg.rope.original_max_position_embeddings == 4096   # defaults to max_position_embeddings
    assert cfg.head_dim == 4 and cfg.num_key_value_heads == 1


def test_transformers5_layout_with_rope_parameters():
    cfg = LatheConfig.from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32,
                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert cfg.rope.rope_theta == 1e6 and cfg.head_dim == 32 and cfg.qk_norm and not cfg.qkv_bias


def test_family_switches():
    qwen2 = LatheConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    llama = LatheConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], "attention_bias": True,
                                      "mlp_bias": True})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    assert llama.qkv_bias and llama.o_bias and llama.mlp_bias


@pytest.mark.parametrize("extra, words", [
    ({"architectures": ["Phi3ForCausalLM"]}, "Phi3ForCausalLM"),
    ({"architectures": ["LlamaForCausalLM"], "attention_dropout": 0.1}, "no dropout.*override_config.attention_drop"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64}, "sliding"),
    ({"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}, "gelu"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "longrope"}}, "longrope"),
])
def test_unsupported_configs_name_the_reason_and_the_fallback(extra, words):
    with pytest.raises(UnsupportedArchitecture, match=words) as err:
        LatheConfig.from_hf_dict({**BASE, **extra})
    assert "transformers fallback" in str(err.value)


def test_incomplete_scaling_names_the_missing_key():
    with pytest.raises(ValueError, match="low_freq_factor"):
        LatheConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_supports_reads_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["GPT2LMHeadModel"]}))
    ok, reason = supports(tmp_path)
    assert not ok and "GPT2LMHeadModel" in reason
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "architectures": ["Qwen2ForCausalLM"]}))
    assert supports(tmp_path) == (True, "Qwen2ForCausalLM")


def test_missing_config_says_what_a_checkpoint_holds(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LatheConfig.from_pretrained(tmp_path)
