"""GLM-4 (`Glm4ForCausalLM`: GLM-4-9B/32B-0414, GLM-Z1; the language model of GLM-4.1V) in lathe's decoder against
transformers (float64): config reading; logits of ragged batches (padded and packed) with RoPE over half of each head
in GLM-4's interleaved pairs (lathe's modules hold q/k's rows permuted to its halves layout) and the norms on the
attention's and MLP's outputs; gradients of every parameter (the permuted ones put back); checkpoints both ways
(the fused gate_up_proj and the pair order restored on saving); a critic; the engine's greedy tokens and log-probs,
and a tensor-parallel engine replica against one process."""

import pytest
import torch

from helpers import assert_close_rel
from lathe.models import glm4, load_lathe_model
from lathe.models.config import LatheConfig
from lathe.models.hf import lathe_from_transformers

from .glm4_tiny import VOCAB, glm4_model
from .moe_reference import assert_critic_round_trip, assert_engine_equals_transformers, \
    assert_gradients_equal_transformers, assert_logits_equal_transformers, assert_tp_replica_equals_one_process, \
    round_trip

GLM4_9B = {"architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
           "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
           "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
           "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "vocab_size": 151552}


@pytest.fixture(scope="module")
def pair():
    hf = glm4_model(dtype=torch.float64)
    return hf, lathe_from_transformers(hf).eval()


def test_config_reads_glm_4_9b_0414():
    cfg = LatheConfig.from_hf_dict(GLM4_9B)
    assert cfg.architecture == "Glm4ForCausalLM" and cfg.rope_interleave and cfg.post_norms
    assert (cfg.head_dim, cfg.rotary_dim, cfg.num_key_value_heads, cfg.rope.rope_theta) == (128, 64, 2, 10000.0)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and cfg.moe is None
    # transformers' defaults where the keys are missing: biases on, RoPE over half of each head, head_dim 128
    d = {k: v for k, v in GLM4_9B.items() if k not in ("partial_rotary_factor", "attention_bias", "head_dim",
                                                         "architectures")}
    cfg = LatheConfig.from_hf_dict({**d, "hidden_size": 2048})
    assert cfg.architecture == "Glm4ForCausalLM" and cfg.qkv_bias and (cfg.head_dim, cfg.rotary_dim) == (128, 64)


def test_rope_order_turns_interleaved_pairs_into_halves():
    """A head's features in the modules' order, rotated in halves, equal the checkpoint's rotated in pairs."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb
    from lathe.models.rope import apply_rotary
    head_dim, rotary = 16, 8
    order = glm4.rope_order(head_dim, rotary)
    assert sorted(order.tolist()) == list(range(head_dim)) and order[rotary:].tolist() == list(range(8, 16))
    x = torch.randn(1, 1, 5, head_dim, dtype=torch.float64)
    freqs = torch.arange(5, dtype=torch.float64)[:, None] * torch.rand(rotary // 2, dtype=torch.float64)
    emb = torch.cat([freqs, freqs], -1)
    want, _ = apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    got = apply_rotary(x[..., order].transpose(1, 2), emb.cos()[None], emb.sin()[None]).transpose(1, 2)
    assert_close_rel(got, want[..., order], rel=1e-12)


def test_logits_equal_transformers(pair):
    hf, lathe = pair
    assert lathe.config.rotary_dim == 8 and hasattr(lathe.model.layers[1], "post_mlp_layernorm")
    assert_logits_equal_transformers(hf, lathe, rel=1e-10)


def test_gradients_equal_transformers_in_the_checkpoint_layout(pair):
    """Every parameter's gradient, lathe's q/k rows and gate/up put back in the checkpoint's layout (`glm4.to_hub`)."""
    hf, lathe = pair
    assert_gradients_equal_transformers(hf, lathe, ("model.layers.0.post_self_attn_layernorm.weight",
                                                    "model.layers.1.post_mlp_layernorm.weight",
                                                    "model.layers.0.mlp.gate_up_proj.weight",
                                                    "model.layers.1.self_attn.k_proj.bias"),
                                        rel=1e-9, layout=lambda grads: glm4.to_hub(grads, lathe.config))


def test_checkpoint_round_trip(tmp_path):
    """transformers' save loads into lathe; lathe's save holds transformers' names (gate_up_proj fused again) and
    transformers loads it to the same logits."""
    hf = glm4_model(seed=1)
    hf.save_pretrained(tmp_path / "hf")
    names, arch = round_trip(tmp_path / "hf", tmp_path / "lathe", VOCAB)
    assert arch == "Glm4ForCausalLM"
    assert names == set(hf.state_dict())
    saved = load_lathe_model(tmp_path / "lathe").state_dict()
    assert_close_rel(saved, load_lathe_model(tmp_path / "hf").state_dict(), rel=0.0, name="lathe's weights again")


def test_a_critic_loads_from_the_policy_checkpoint_and_reads_its_own_save_back(tmp_path):
    """transformers has no GLM-4 token-classification class: lathe's value model loads the causal LM's backbone (its
    head at zero) and reads back the critic it saves (`Glm4ForTokenClassification`, lathe's name)."""
    assert_critic_round_trip(glm4_model(seed=6), tmp_path, VOCAB, "Glm4ForTokenClassification", sparse=None)


def test_engine_greedy_equals_transformers_and_its_log_probs_the_forward(tmp_path):
    hf = glm4_model(seed=2)
    hf.save_pretrained(tmp_path)
    assert_engine_equals_transformers(hf, load_lathe_model(tmp_path).eval(), tmp_path)


def test_a_tensor_parallel_engine_replica_generates_what_one_process_generates(tmp_path):
    """Over 2 gloo ranks (heads with their permuted rotary rows, the MLP cut): greedy, sampled, and greedy after new
    weights, as one process."""
    assert_tp_replica_equals_one_process(glm4_model(seed=4), tmp_path)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "k_proj", "gate_up_proj"]])
def test_lora_adapters_move_both_ways_with_peft(tmp_path, targets):
    """lathe's adapters on GLM-4 (q/k's rows permuted, gate and up adapted apart) save as a PEFT adapter of
    transformers' modules (gate_up_proj at twice the rank, B block-diagonal) that PEFT applies to the same logits; an
    adapter PEFT trained (one A shared by gate and up) loads into lathe to the same logits; and lathe's save reads back
    exactly. `gate_up_proj` as a target names lathe's two layers."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    from lathe.models.lora import apply_lora, load_adapter, lora_layers, model_paths, read_adapter, save_adapter
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    hf = glm4_model(seed=7, dtype=torch.float64)
    lathe = lathe_from_transformers(hf).eval()
    names = apply_lora(lathe, rank=2, alpha=3.0, target_modules=targets)
    assert "model.layers.0.mlp.up_proj" in names and ("model.layers.0.mlp.down_proj" in names) == (
        targets == "all-linear")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in lora_layers(lathe):
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen, dtype=torch.float64))
        want = lathe(ids).logits
    save_adapter(lathe, tmp_path / "lathe")
    peft_model = peft.PeftModel.from_pretrained(glm4_model(seed=7, dtype=torch.float64), tmp_path / "lathe").eval()
    with torch.no_grad():
        assert_close_rel(peft_model(ids).logits, want, rel=1e-10, name="PEFT with lathe's adapter")
    again = lathe_from_transformers(hf).eval()
    apply_lora(again, rank=2, alpha=3.0, target_modules=targets)
    load_adapter(again, model_paths(again, read_adapter(tmp_path / "lathe")[1]), "lathe's adapter")
    assert_close_rel(dict(again.named_parameters()), dict(lathe.named_parameters()), rel=0.0, name="read back")
    # an adapter of PEFT's own (rank 2, one A for gate_up_proj), its B random
    config = peft.LoraConfig(r=2, lora_alpha=3.0, target_modules=["q_proj", "k_proj", "gate_up_proj"])
    theirs = peft.get_peft_model(glm4_model(seed=7, dtype=torch.float64), config)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        want = theirs(ids).logits
    theirs.save_pretrained(tmp_path / "peft")
    mine = lathe_from_transformers(hf).eval()
    apply_lora(mine, rank=2, alpha=3.0, target_modules=["q_proj", "k_proj", "gate_up_proj"])
    load_adapter(mine, model_paths(mine, read_adapter(tmp_path / "peft")[1]), "PEFT's adapter")
    with torch.no_grad():
        assert_close_rel(mine(ids).logits, want, rel=1e-10, name="lathe with PEFT's adapter")
