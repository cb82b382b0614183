"""Tests for lathe.workers.rollout with lathe's engine as the backend (`actor_rollout_ref.rollout.name=lathe|auto`)."""

import gc
import logging
import weakref

import pytest
import torch

from lathe.data.builtin import builtin_tokenizer
from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models.decoder import LatheCausalLM
from lathe.rollout.hf import HFRollout
from lathe.rollout.build import build_engine, eos_token_ids
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import assert_close_rel, plan_of, worker_ppo_batch

from .test_actor_rollout_ref import _same_weights

# Ragged prompts; the first two share a 17-token prefix (more than one 16-token KV block) for prefix caching.
PROMPT_IDS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
              [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 30, 31],
              [9, 30], [40, 41, 42, 43, 44, 45], [7]]
SECOND_EOS = 27   # listed by the model's generation_config only, as Qwen2.5-Instruct lists <|im_end|>


def _qwen2(seed: int = 2):
    """A tiny random Qwen2 (large init, so greedy continuations vary) whose generation_config has two eos ids."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, initializer_range=0.2, bos_token_id=None,
                      eos_token_id=[tok.eos_token_id, SECOND_EOS], pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(cfg)


def _worker(load_cfg, rollout: str, *overrides, model=None):
    cfg = load_cfg(f"actor_rollout_ref.rollout.name={rollout}", "data.max_prompt_length=24",
                   "data.max_response_length=12", "actor_rollout_ref.actor.optim.lr=1e-2", *overrides)
    return ActorRolloutRefWorker(cfg, model if model is not None else _qwen2(), builtin_tokenizer(),
                                 plan=plan_of(cfg, needs_ref=True), total_steps=10, device=torch.device("cpu"))


def _prompts():
    from lathe.batch import Batch
    return Batch(non_tensors={"prompt_ids": [list(p) for p in PROMPT_IDS]})


GREEDY = SamplingParams(n=2, temperature=0, max_tokens=12)


def test_eos_ids_are_the_tokenizers_then_the_generation_configs():
    assert eos_token_ids(builtin_tokenizer(), _qwen2()) == [1, SECOND_EOS]
    assert eos_token_ids(builtin_tokenizer(), object()) == [1]


def test_auto_picks_the_engine_for_lathes_decoder_and_keeps_no_transformers_copy(load_cfg, caplog):
    model = _qwen2()
    alive = weakref.ref(model)
    with caplog.at_level(logging.INFO, logger="lathe"):
        worker = _worker(load_cfg, "auto", model=model)
    assert "rollout: lathe engine (actor_rollout_ref.rollout.name=auto and lathe's decoder runs Qwen2ForCausalLM)" \
        in caplog.text
    engine = worker.rollout.backend
    assert isinstance(engine, LatheEngine) and isinstance(engine.model, LatheCausalLM)
    assert engine.model.dtype == torch.float32 and engine.max_model_len == 24 + 12
    assert engine.eos_ids == [1, SECOND_EOS]
    assert _same_weights(worker.model, engine.model)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight, "tied weights stay tied"
    for (name, a), b in zip(worker.model.state_dict().items(), engine.model.state_dict().values()):
        assert a.data_ptr() == b.data_ptr(), f"{name}: the engine runs on the actor's own tensors (one copy)"
    assert not any(p.requires_grad for p in engine.model.parameters())
    assert all(p.requires_grad for p in worker.model.parameters()), "the actor's parameters stay trainable"
    del model
    gc.collect()
    assert alive() is None, "the transformers module must not be kept beside the engine"


def test_engine_greedy_responses_equal_the_hf_rollouts_token_for_token(load_cfg):
    hf, engine = _worker(load_cfg, "hf"), _worker(load_cfg, "lathe")
    assert isinstance(hf.rollout.backend, HFRollout) and isinstance(engine.rollout.backend, LatheEngine)
    a, b = hf.generate_sequences(_prompts(), GREEDY), engine.generate_sequences(_prompts(), GREEDY)
    reasons = list(a["finish_reason"])
    assert "stop" in reasons and "length" in reasons, "precondition: some responses end on an eos, some do not"
    assert any(r[m.bool()][-1] == SECOND_EOS for r, m in zip(a["responses"], a["response_mask"])), \
        "precondition: a response ends on the generation_config's second eos"
    assert reasons == list(b["finish_reason"])
    for key in ("responses", "response_mask", "prompts", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(a[key], b[key]), key
    assert_close_rel(b["rollout_log_probs"], a["rollout_log_probs"], name="engine log-probs vs transformers'")


def test_engine_follows_actor_updates_and_equals_a_fresh_engine(load_cfg, rollout_batch):
    worker = _worker(load_cfg, "lathe")
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    before = worker.rollout.backend.generate(PROMPT_IDS, sampled)   # fills the prefix cache with the old weights' KV
    worker.update_actor(worker_ppo_batch(worker, rollout_batch))
    worker.sync_weights()                                   # the engine forgets the old weights' prefixes
    assert _same_weights(worker.model, worker.rollout.backend.model)
    fresh = build_engine(worker.cfg.actor_rollout_ref.rollout, worker.model, [1, SECOND_EOS])
    for params in (sampled, GREEDY):
        after, expected = worker.rollout.backend.generate(PROMPT_IDS, params), fresh.generate(PROMPT_IDS, params)
        assert after.token_ids == expected.token_ids and after.finish_reasons == expected.finish_reasons
        assert after.logprobs == expected.logprobs
    assert after.token_ids != before.token_ids or after.logprobs != before.logprobs
    resampled = worker.rollout.backend.generate(PROMPT_IDS, sampled)
    assert resampled.logprobs != before.logprobs, "the update changed the policy the engine samples from"


def test_free_cache_engine_releases_the_kv_cache_between_generations(load_cfg):
    worker = _worker(load_cfg, "lathe")
    assert not worker.rollout.free_cache_engine and worker.rollout.backend.kv_cache.allocated, "CPU: the cache stays allocated"
    first = worker.generate_sequences(_prompts(), GREEDY)
    worker.rollout.free_cache_engine = True          # what a CUDA device with rollout.free_cache_engine=true sets
    second = worker.generate_sequences(_prompts(), GREEDY)
    assert not worker.rollout.backend.kv_cache.allocated, "asleep after generating"
    third = worker.generate_sequences(_prompts(), GREEDY)
    assert torch.equal(first["responses"], second["responses"]) and torch.equal(first["responses"], third["responses"])


@pytest.mark.gpu
def test_cuda_engine_runs_in_the_rollout_dtype_and_sleeps_while_training(load_cfg, rollout_batch):
    cfg = load_cfg("actor_rollout_ref.rollout.name=lathe", "data.max_prompt_length=24", "data.max_response_length=12",
                   "actor_rollout_ref.rollout.gpu_memory_utilization=0.3")
    worker = ActorRolloutRefWorker(cfg, _qwen2(), builtin_tokenizer(), plan=plan_of(cfg, needs_ref=True),
                                   total_steps=10, device=torch.device("cuda"))
    assert worker.rollout.backend.model.dtype == torch.bfloat16 and worker.rollout.backend.model.device.type == "cuda"
    assert worker.rollout.free_cache_engine and not worker.rollout.backend.kv_cache.allocated
    out = worker.generate_sequences(_prompts(), GREEDY)
    assert out["responses"].shape[0] == len(PROMPT_IDS) * 2 and not worker.rollout.backend.kv_cache.allocated
    worker.update_actor(worker_ppo_batch(worker, rollout_batch))
    worker.sync_weights()
    assert worker.generate_sequences(_prompts(), GREEDY)["responses"].shape[0] == len(PROMPT_IDS) * 2


def _gpt2():
    """A tiny random GPT-2: an architecture lathe's decoder does not implement (the actor trains transformers' module
    and `rollout.name=auto` generates with transformers)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    tok = builtin_tokenizer()
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                     bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("key", ["quantization=fp8", "kv_cache_dtype=fp8"])
def test_an_fp8_engine_setting_on_a_transformers_rollout_is_refused(load_cfg, key):
    """`rollout.name=auto` (or a verl backend's name) over an architecture lathe's decoder does not implement resolves
    to transformers generate, which has neither FP8 weights nor an FP8 KV cache: the setting is refused naming it
    (silently dropped, the rollout would run unquantised while token TIS, turned on for it, corrects nothing)."""
    with pytest.raises(ValueError, match=f"actor_rollout_ref.rollout.{key}.*generates with transformers"):
        _worker(load_cfg, "auto", f"actor_rollout_ref.rollout.{key}", model=_gpt2())


def test_an_idle_replica_of_data_parallel_attention_serves_the_others_awake():
    """A data-parallel-attention replica called with no prompts (its share empty) wakes its KV cache, serves the other
    replicas' steps and sleeps again (asleep, it would make every replica decode eagerly), and returns None; a
    worker without data-parallel attention is never called so and does nothing."""
    from types import SimpleNamespace

    from lathe.batch import Batch
    from lathe.workers.rollout import Rollout
    calls = []
    backend = SimpleNamespace(wake_up=lambda: calls.append("wake_up"), sleep=lambda: calls.append("sleep"),
                              generate=lambda prompts, params: calls.append(("generate", len(prompts))))
    rollout = object.__new__(Rollout)
    rollout.__dict__.update(dp=object(), agent=None, backend=backend, free_cache_engine=True, replica=None, stream=None,
                            actor=SimpleNamespace(sharded=False), device=torch.device("cpu"),
                            tp=SimpleNamespace(rank=0))
    empty = Batch(non_tensors={"prompt_ids": []})
    assert rollout.generate_sequences(empty, SamplingParams(max_tokens=4)) is None
    assert calls == ["wake_up", ("generate", 0), "sleep"]
    calls.clear()
    rollout.agent = SimpleNamespace(serve_replicas=lambda: calls.append("serve_replicas"))
    assert rollout.generate_sequences(empty, SamplingParams(max_tokens=4)) is None
    assert calls == ["wake_up", "serve_replicas", "sleep"]
    calls.clear()
    rollout.dp = None
    assert rollout.generate_sequences(empty, SamplingParams(max_tokens=4)) is None and calls == []
