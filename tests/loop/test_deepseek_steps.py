"""A tiny DeepSeek-V3, GLM-4.5 and HY-V3 checkpoint each train for two GRPO steps on lathe's decoder and engine, with
routing replay R3 (the engine records their group-limited choices, the trainer's forwards replay them); the checkpoint
each saves reads back into transformers' class with every tensor (the per-expert names, the selection bias)."""

import pytest
import torch

from .test_ppo import reads_back, save_with_builtin_tokenizer, steps_from


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "hy_v3"])
def test_two_steps_with_a_deepseek_style_checkpoint(tmp_path, family):
    from transformers import DeepseekV3ForCausalLM, Glm4MoeForCausalLM, HYV3ForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.deepseek import DeepseekMoeBlock

    from models.deepseek_tiny import deepseek_model
    from models.glm_tiny import glm_model
    from models.hy_tiny import hy_model
    tok = builtin_tokenizer()
    build, hf_class = {"deepseek_v3": (deepseek_model, DeepseekV3ForCausalLM),
                       "glm4_moe": (glm_model, Glm4MoeForCausalLM), "hy_v3": (hy_model, HYV3ForCausalLM)}[family]
    model = save_with_builtin_tokenizer(build(vocab_size=len(tok), num_attention_heads=2, num_key_value_heads=2,
                                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                                        tmp_path / "model")
    trainer, metrics = steps_from(tmp_path, model, "actor_rollout_ref.actor.router_replay.mode=R3",
                                  "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert any(isinstance(m, DeepseekMoeBlock) for m in trainer.worker.model.modules())
    assert trainer.worker.rollout.name == "lathe"                  # rollout.name=auto: lathe's engine runs it
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert 0 <= metrics[2]["actor/routing_replay_changed"] <= 1      # replayed: the share it overrode is reported
    assert reads_back(hf_class, tmp_path / "run")


def test_mtp_enable_copies_a_glm_checkpoint_s_mtp_layer_into_its_saves_and_resumes(tmp_path):
    """GLM-4.5's MTP layer (model.layers.<n>), which lathe's decoder loads but does not run: with mtp.enable=true every
    save carries it as the original holds it, and a run resumes from such a save; without, saves leave it out."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from lathe.data.builtin import builtin_tokenizer

    from models.glm_tiny import glm_model
    tok = builtin_tokenizer()
    path = save_with_builtin_tokenizer(glm_model(vocab_size=len(tok), num_attention_heads=2, num_key_value_heads=2,
                                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
                                       tmp_path / "model")
    file = path / "model.safetensors"
    mtp = {"model.layers.3.eh_proj.weight": torch.randn(32, 64),
           "model.layers.3.mlp.experts.0.up_proj.weight": torch.randn(16, 32, dtype=torch.bfloat16)}
    save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})

    def saved_mtp(run_dir, step: int) -> dict:
        with safe_open(str(run_dir / f"global_step_{step}" / "actor" / "huggingface" / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.3.")}

    keep = ["actor_rollout_ref.model.mtp.enable=true", "trainer.save_freq=1"]
    steps_from(tmp_path, path, *keep, steps=1)
    resumed, metrics = steps_from(tmp_path, path, *keep, steps=2)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "global_step_1"
    assert resumed.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    for step in (1, 2):
        got = saved_mtp(tmp_path / "run", step)
        assert got.keys() == mtp.keys() and all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                                                for k, v in mtp.items())
    plain = tmp_path / "plain"
    plain.mkdir()
    steps_from(plain, path, "trainer.save_freq=1", steps=1)
    assert saved_mtp(plain / "run", 1) == {}
