"""Expert parallelism over Nemotron-H's experts (non-gated relu^2 experts between latent projections,
`lathe.models.nemotron_h`) equals the one-process computation: the actor worker on a tiny Nemotron-H (Mamba2,
attention, MLP and MoE layers), FSDP over 4 gloo ranks x EP 2, 3 updates: metrics and weights equal the one-process
run's, and every rank hands the engine the whole tensors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel

from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights

from .conftest import VOCAB
from .test_parallel import assert_same_run, run_ranks, train

pytestmark = pytest.mark.slow

EP = ("actor_rollout_ref.actor.fsdp_config.expert_parallel_size=2",)


def tiny_nemotron() -> LatheCausalLM:
    """Nemotron-H of 4 layers (Mamba2, MoE, attention, MoE), 4 experts top-2 on a latent width of 12."""
    cfg = LatheConfig.from_hf_dict({
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": VOCAB,
        "hidden_size": 32, "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24,
        "moe_latent_size": 12, "routed_scaling_factor": 2.5, "max_position_embeddings": 64,
        "tie_word_embeddings": False})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.2)
    return model


def ep_job(world: int) -> dict:
    return {"fsdp": train(world, -1, model_fn=tiny_nemotron, engine=True, overrides=EP)}


def test_fsdp_4_x_ep_2_updates_as_one_process(tmp_path):
    one = train(1, -1, model_fn=tiny_nemotron)
    [ranks] = run_ranks(4, tmp_path / "ranks", {}, fn=ep_job)
    got = ranks[0]["fsdp"]
    assert got["experts_mesh"] == (("dp_shard_mod_ep", "ep"), (2, 2))     # experts: over 2 groups x EP 2
    assert_same_run(got, one)
    assert any(".mixer.experts." in k for k in one["weights"])
    for rank in ranks:          # (the trained tensors: the selection bias, a buffer, is not synced)
        engine = rank["fsdp"]["engine"]
        assert "model.layers.1.mixer.experts.up_proj" in engine
        assert_close_rel(engine, {k: one["weights"][k] for k in engine}, rel=1e-5, name="engine weights")
