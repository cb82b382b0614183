"""Tests for lathe.workers.actor_rollout_ref: which implementation the actor and the rollout run, and weight sync."""

import logging

import pytest
import torch

from lathe.data.builtin import builtin_tokenizer
from lathe.generation import SamplingParams
from lathe.models.decoder import LatheCausalLM
from lathe.models.hf import build_builtin_model
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import assert_close_rel, plan_of, worker_ppo_batch


def _worker(load_cfg, *overrides, model=None, need_ref=True):
    cfg = load_cfg("actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.model.use_remove_padding=true",
                   *overrides)
    tok = builtin_tokenizer()
    model = model if model is not None else build_builtin_model("tiny", vocab_size=len(tok), seed=0)
    return ActorRolloutRefWorker(cfg, model, tok, plan=plan_of(cfg, needs_ref=need_ref), total_steps=10,
                                 device=torch.device("cpu"))


def _same_weights(lathe, hf) -> bool:
    hf_state = hf.state_dict()
    return all(torch.equal(t, hf_state[name]) for name, t in lathe.state_dict().items())


def test_builtin_actor_runs_lathe_with_a_synced_transformers_rollout(load_cfg, rollout_batch, caplog):
    with caplog.at_level(logging.INFO, logger="lathe"):
        worker = _worker(load_cfg, "actor_rollout_ref.rollout.name=hf")
    assert "actor: lathe decoder (Qwen2ForCausalLM" in caplog.text
    assert "rollout: transformers generate (actor_rollout_ref.rollout.name=hf)" in caplog.text
    assert isinstance(worker.model, LatheCausalLM) and isinstance(worker.ref.model, LatheCausalLM)
    rollout_model = worker.rollout.backend.model
    assert not isinstance(rollout_model, LatheCausalLM) and worker.model.model.gradient_checkpointing
    assert _same_weights(worker.model, rollout_model), "the seeded built-in weights are kept by the conversion"
    assert rollout_model.model.embed_tokens.weight.data_ptr() != worker.model.model.embed_tokens.weight.data_ptr()
    # the trainer's log-probs of a rollout agree with the rollout's own
    params = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=0)
    prompts = [[5, 6, 7], [8, 9]]
    out = worker.rollout.backend.generate(prompts, params)
    from lathe.rollout.base import to_batch
    gen = to_batch(prompts, out, worker.tokenizer.pad_token_id, params.n)
    logp = worker.compute_log_prob(gen)["old_log_probs"]
    mask = gen["response_mask"].bool()
    assert_close_rel(logp[mask], gen["rollout_log_probs"][mask], name="trainer log-probs vs the rollout's")

    before = {k: v.clone() for k, v in rollout_model.state_dict().items()}
    metrics = worker.update_actor(worker_ppo_batch(worker, rollout_batch))
    assert metrics["actor/grad_norm"] > 0
    worker.sync_weights()
    assert not torch.equal(before["model.embed_tokens.weight"], rollout_model.state_dict()["model.embed_tokens.weight"])
    assert _same_weights(worker.model, rollout_model), "sync_weights pushes the new weights into the rollout"


def test_impl_hf_shares_one_transformers_module(load_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="lathe"):
        worker = _worker(load_cfg, "actor_rollout_ref.model.impl=hf")
    assert worker.rollout.backend.model is worker.model and not isinstance(worker.model, LatheCausalLM)
    assert "actor: transformers Qwen2ForCausalLM" in caplog.text
    assert "rollout: transformers generate (actor_rollout_ref.rollout.name=auto and the actor runs" in caplog.text


def _gelu_model():
    """A Qwen2 with an activation lathe's decoder does not implement."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = builtin_tokenizer()
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu",
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))


def test_unsupported_architecture_falls_back_or_fails_when_lathe_is_required(load_cfg, rollout_batch, caplog):
    with caplog.at_level(logging.INFO, logger="lathe"):
        worker = _worker(load_cfg, model=_gelu_model(), need_ref=False)
    assert worker.model is worker.rollout.backend.model and not isinstance(worker.model, LatheCausalLM)
    assert "hidden_act='gelu'" in caplog.text
    logp = worker.compute_log_prob(rollout_batch(rows=2))["old_log_probs"]   # runs padded, use_remove_padding or not
    assert torch.isfinite(logp).all()
    with pytest.raises(ValueError, match="actor_rollout_ref.model.impl=lathe"):
        _worker(load_cfg, "actor_rollout_ref.model.impl=lathe", model=_gelu_model(), need_ref=False)
    with pytest.raises(ValueError, match=r"rollout.name=lathe: .*covers .*GptOssForCausalLM.*Qwen3_5ForCausalLM.* not "
                                         r"implement Qwen2ForCausalLM.*rollout.name=hf"):   # the covered families named
        _worker(load_cfg, "actor_rollout_ref.rollout.name=lathe", model=_gelu_model(), need_ref=False)


def test_the_actor_recomputes_the_first_n_layers_and_a_transformers_fallback_refuses_a_count(load_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="lathe"):
        worker = _worker(load_cfg, "actor_rollout_ref.model.gradient_checkpointing_layers=1", need_ref=False)
    stack = worker.model.model
    assert stack.gradient_checkpointing and stack.gradient_checkpointing_layers == 1
    assert f"the first 1 of {len(stack.layers)} decoder layers recompute" in caplog.text
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.gradient_checkpointing_layers=1: only lathe's "
                                         r"decoder .*actor_rollout_ref\.model\.impl=hf"):
        _worker(load_cfg, "actor_rollout_ref.model.gradient_checkpointing_layers=1", model=_gelu_model(),
                need_ref=False)


@pytest.mark.parametrize("rollout", ["hf", "lathe"])
def test_checkpoint_round_trip_resyncs_the_rollout(load_cfg, rollout_batch, tmp_path, rollout):
    name = f"actor_rollout_ref.rollout.name={rollout}"
    worker = _worker(load_cfg, name)
    worker.update_actor(worker_ppo_batch(worker, rollout_batch))
    worker.save_checkpoint(tmp_path / "actor")
    restored = _worker(load_cfg, name)
    assert not _same_weights(worker.model, restored.rollout.backend.model)
    restored.load_checkpoint(tmp_path / "actor")
    assert _same_weights(worker.model, restored.model)
    assert _same_weights(worker.model, restored.rollout.backend.model), "load_checkpoint pushes the weights into the rollout"
