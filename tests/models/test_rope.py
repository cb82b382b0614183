"""RoPE frequencies and cos/sin equal transformers' for every scaling variant lathe reads."""

import pytest
import torch

from lathe.models.config import LatheConfig
from lathe.models.rope import RotaryEmbedding, apply_rotary, default_inv_freq

from helpers import assert_close_rel

SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _configs(scaling):
    from transformers import LlamaConfig
    hf = LlamaConfig(vocab_size=11, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                     max_position_embeddings=256, rope_theta=500000.0, rope_scaling=dict(scaling))
    d = hf.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    return hf, LatheConfig.from_hf_dict(d)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_cos_sin_equal_transformers(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    hf_cfg, cfg = _configs(SCALINGS[kind])
    assert cfg.rope.rope_type == kind
    ours = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    theirs = LlamaRotaryEmbedding(hf_cfg)
    x = torch.zeros(1, 1, dtype=torch.float32)
    positions = torch.arange(200).unsqueeze(0)   # inside max_position_embeddings
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = theirs(x, positions)
    assert_close_rel(cos, ref_cos, name="cos")
    assert_close_rel(sin, ref_sin, name="sin")


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn"])
def test_scaling_changes_the_frequencies(kind):
    _, cfg = _configs(SCALINGS[kind])
    scaled = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings).inv_freq
    assert not torch.allclose(scaled, default_inv_freq(cfg.rope.rope_theta, cfg.head_dim))


def test_dynamic_grows_the_base_beyond_max_positions():
    _, cfg = _configs(SCALINGS["dynamic"])
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    short = rope(torch.arange(10), torch.float32)[0]
    long = rope(torch.arange(400), torch.float32)[0]
    assert torch.equal(rope(torch.arange(10), torch.float32)[0], short)
    assert not torch.allclose(long[:10], short, atol=1e-6)


def test_rotation_preserves_norm_and_is_relative():
    torch.manual_seed(0)
    _, cfg = _configs(SCALINGS["llama3"])
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    q, k = torch.randn(1, 2, cfg.head_dim), torch.randn(1, 2, cfg.head_dim)
    def score(pq, pk):
        cq, sq = rope(torch.tensor([pq]), torch.float32)
        ck, sk = rope(torch.tensor([pk]), torch.float32)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum(-1)
    assert_close_rel(apply_rotary(q, *rope(torch.tensor([7]), torch.float32)).norm(dim=-1), q.norm(dim=-1),
                     name="norm after rotation")
    assert_close_rel(score(13, 10), score(5, 2), name="score at another absolute position")
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)
