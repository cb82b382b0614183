"""Tiny fp32 Qwen2 models, verl-keyed actor configs and rollout-layout batches for the train tests."""

import pytest
import torch

from lathe.config import load_config
from lathe.generation import RolloutOutput
from lathe.rollout.base import to_batch

VOCAB = 40
PAD = 0
# Norm-relative tolerance for parameter updates of two fp32 paths (micro-batched vs whole, packed vs padded,
# compiled vs eager). The gradients sum per-token terms of both signs (random advantages, returns), so their
# rounding is a larger share of the result than in a forward: up to ~2e-6 here.
UPDATE_REL = 3e-5

# 4 prompts x rollout.n=2 = 8 sequences per step; ppo_mini_batch_size=2 prompts -> 2 mini-batches of 4.
BASE_OVERRIDES = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-3"]


@pytest.fixture
def make_model():
    def make(seed: int = 0):
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                          eos_token_id=1, pad_token_id=PAD)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return Qwen2ForCausalLM(cfg)
    return make


@pytest.fixture
def make_lathe(make_model):
    """make_lathe(seed=0) -> lathe's decoder holding the weights of make_model(seed)."""
    from lathe.models.hf import lathe_from_transformers
    return lambda seed=0: lathe_from_transformers(make_model(seed))


@pytest.fixture
def load_cfg():
    """load_cfg(*overrides) -> the full config with the tiny batch sizes above."""
    return lambda *overrides: load_config(None, [*BASE_OVERRIDES, *overrides])


@pytest.fixture
def rollout_batch():
    """rollout_batch(rows=8, seed=0) -> `to_batch` output with ragged random prompts and responses."""
    def make(rows: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(rows)]
        responses = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                     for _ in range(rows)]
        out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["stop"] * rows)
        return to_batch(prompts, out, PAD, n=1)
    return make
