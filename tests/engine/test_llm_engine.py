"""Tests for lathe.engine.llm_engine.LatheEngine against transformers on tiny random checkpoints (CPU, fp32)."""

import time
from types import SimpleNamespace

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel

from .conftest import PROMPTS

MAX = 10


def _engine(path, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 64)
    return LatheEngine.from_pretrained(path, eos_token_id=kw.pop("eos", None), **kw)


@torch.no_grad()
def _hf_greedy(hf, prompt, max_tokens):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _teacher_forced(model, prompt, response, temperature):
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_equals_transformers_generate(checkpoints, family, prefix_caching):
    path, hf = checkpoints[family]
    engine = _engine(path, enable_prefix_caching=prefix_caching)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=MAX))
    expected = [_hf_greedy(hf, p, MAX) for p in PROMPTS for _ in range(2)]
    assert out.token_ids == expected
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"
    assert out.finish_reasons == ["length"] * len(expected)


def test_moe_greedy_equals_transformers_generate(tmp_path):
    """Qwen3-MoE (`lathe.models.moe`) in the engine, its dense layer's projections fused: transformers' greedy
    tokens."""
    from models.lathe_tiny import MOE, save_hf
    path, hf = save_hf(tmp_path, MOE)
    engine = _engine(path, fuse_projections=True)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=MAX))
    expected = [_hf_greedy(hf, p, MAX) for p in PROMPTS for _ in range(2)]
    assert out.token_ids == expected
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"


def test_log_probs_equal_teacher_forced_forward(checkpoints):
    path, _ = checkpoints["qwen2"]
    model = load_lathe_model(path)
    engine = _engine(path)
    for params, t in ((SamplingParams(temperature=0, max_tokens=MAX), 1.0),
                      (SamplingParams(n=3, temperature=0.7, top_k=20, top_p=0.9, max_tokens=MAX, seed=1), 0.7)):
        out = engine.generate(PROMPTS, params)
        prompts = [p for p in PROMPTS for _ in range(params.n)]
        for prompt, ids, lps in zip(prompts, out.token_ids, out.logprobs):
            assert len(ids) == len(lps) == MAX
            ref = _teacher_forced(model, prompt, ids, t)
            assert_close_rel(lps, ref, name="log-probs")


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    path, _ = checkpoints["llama"]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=7)
    ref = _engine(path).generate(PROMPTS, params).token_ids
    assert _engine(path).generate(PROMPTS, params).token_ids == ref
    # one sequence at a time, and a cache so small that sequences are preempted: same samples
    assert _engine(path, max_num_seqs=1).generate(PROMPTS, params).token_ids == ref
    small = _engine(path, num_kv_blocks=10, reserve_new_tokens=False)
    out = small.generate(PROMPTS, params)
    assert out.token_ids == ref
    assert small.scheduler.num_preemptions > 0 and out.metrics["rollout/num_preemptions"] > 0
    reserving = _engine(path, num_kv_blocks=10)          # the same cache, admission reserving for the responses
    out = reserving.generate(PROMPTS, params)
    assert out.token_ids == ref and out.metrics["rollout/num_preemptions"] == 0
    # more prompts after them do not change their samples
    more = _engine(path).generate(PROMPTS + [[5, 6, 7]], params).token_ids
    assert more[:len(ref)] == ref
    assert len({tuple(t) for t in ref[:3]}) > 1, "the n samples of a prompt differ"
    other = _engine(path).generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=8))
    assert other.token_ids != ref


def test_tiny_kv_budget_preempts_and_still_matches(checkpoints):
    path, hf = checkpoints["qwen3"]
    engine = _engine(path, num_kv_blocks=8, reserve_new_tokens=False)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    assert engine.scheduler.num_preemptions > 0
    assert out.token_ids == [_hf_greedy(hf, p, MAX) for p in PROMPTS]
    assert engine.block_manager.num_free_blocks == 8


def test_update_weights_invalidates_shared_prefixes(checkpoints, tmp_path):
    from models.lathe_tiny import save_hf
    path, _ = checkpoints["qwen2"]
    new_path, _ = save_hf(tmp_path, "qwen2", seed=1)
    engine = _engine(path)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    before = engine.generate(PROMPTS, params)
    engine.update_weights(load_lathe_model(new_path).state_dict().items())
    after = engine.generate(PROMPTS, params)
    fresh = _engine(new_path).generate(PROMPTS, params)
    assert after.token_ids == fresh.token_ids and after.token_ids != before.token_ids
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)


def test_fused_projections_sample_the_same_and_take_weight_updates(checkpoints, tmp_path):
    """The engine with fused q/k/v and gate/up matmuls (CUDA's default for small models) samples what the unfused
    engine samples, and an update of its weights reaches the fused tensors."""
    from models.lathe_tiny import save_hf
    path, _ = checkpoints["qwen2"]
    new_path, _ = save_hf(tmp_path, "qwen2", seed=1)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=MAX, seed=3)
    plain = LatheEngine(load_lathe_model(path), eos_token_id=None, block_size=4, num_kv_blocks=64)
    fused = LatheEngine(load_lathe_model(path), eos_token_id=None, block_size=4, num_kv_blocks=64,
                        fuse_projections=True)
    assert fused.model.model.layers[0].mlp.gate_up_weight is not None
    assert fused.generate(PROMPTS, params).token_ids == plain.generate(PROMPTS, params).token_ids
    fused.update_weights(load_lathe_model(new_path).state_dict().items())
    fresh = LatheEngine(load_lathe_model(new_path), eos_token_id=None, block_size=4, num_kv_blocks=64)
    assert fused.generate(PROMPTS, params).token_ids == fresh.generate(PROMPTS, params).token_ids


def test_stop_ids_min_tokens_ignore_eos(checkpoints):
    path, hf = checkpoints["llama"]
    prompt = PROMPTS[0]
    greedy = _hf_greedy(hf, prompt, MAX)
    eos = greedy[2]
    first = greedy.index(eos)
    engine = _engine(path, eos=eos)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX))
    assert out.token_ids[0] == greedy[:first + 1] and out.finish_reasons == ["stop"]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    assert out.token_ids[0] == greedy and out.finish_reasons == ["length"]
    stop = greedy[4]
    out = _engine(path).generate([prompt], SamplingParams(temperature=0, max_tokens=MAX, stop_token_ids=[stop]))
    assert out.token_ids[0] == greedy[:greedy.index(stop) + 1] and out.finish_reasons == ["stop"]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX, min_tokens=first + 2))
    assert len(out.token_ids[0]) > first + 1 and eos not in out.token_ids[0][:first + 2]
    out = engine.generate([prompt, [3]], SamplingParams(temperature=0, max_tokens=0))
    assert out.token_ids == [[], []] and out.finish_reasons == ["length", "length"]


def test_sleep_frees_kv_and_wake_up_restores(checkpoints):
    path, hf = checkpoints["qwen2"]
    engine = _engine(path)
    params = SamplingParams(temperature=0, max_tokens=MAX)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    assert not engine.kv_cache.allocated
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(PROMPTS, params)
    engine.wake_up()
    assert engine.generate(PROMPTS, params).token_ids == before.token_ids


def test_releasing_memory_keeps_the_decode_graphs_only_over_a_fixed_address_cache(checkpoints):
    """`_release_memory` (sleep near the device's limit, or a kept cache that no longer fits at wake-up) drops the
    decode graphs, whose KV cache may land elsewhere, unless the cache is fixed-address memory (`lathe.engine.vmm`,
    CUDA only: stood in for here), which comes back under the graphs' addresses."""
    engine = _engine(checkpoints["qwen2"][0])
    resets = []
    engine.runner.graphs = SimpleNamespace(reset=lambda: resets.append(1))
    engine._release_memory()
    assert resets == [1]
    engine.kv_cache._fixed = SimpleNamespace(unmap=lambda: None)
    engine._release_memory()
    assert resets == [1] and engine.kv_cache.fixed_address


def test_wake_up_frees_cublas_workspaces_before_taking_the_kept_cache_back(checkpoints, monkeypatch):
    """The update's backward makes its cuBLAS workspace inside the sleeping engine's kept cache: the engine frees the
    workspaces before it takes the cache back from the allocator, so that the cache lands where it was and its decode
    graphs are kept (they were captured again at every step while a 32 MiB workspace split a layer's segment)."""
    from lathe import device as accel
    engine = _engine(checkpoints["qwen2"][0])
    params = SamplingParams(temperature=0, max_tokens=MAX)
    before = engine.generate(PROMPTS, params)
    calls = []
    monkeypatch.setattr(accel, "clear_blas_workspaces", lambda device: calls.append("clear"))
    allocate = engine.kv_cache.allocate
    monkeypatch.setattr(engine.kv_cache, "allocate", lambda: (calls.append("allocate"), allocate())[1])
    engine.sleep()
    engine._cache_kept = True           # (a CPU engine never keeps it: as a GPU one with room to spare)
    calls.clear()
    engine.wake_up()
    assert calls == ["clear", "allocate"]
    assert engine.generate(PROMPTS, params).token_ids == before.token_ids


def test_a_call_that_fails_midway_leaves_nothing_running_and_its_own_error_raised(checkpoints, monkeypatch):
    """A step that raises mid-call (a decode graph's capture out of device memory, say) drops the call's sequences
    and their KV blocks: the caller's cleanup can put the engine to sleep (it refused while sequences held blocks,
    and its error hid the one that stopped the call), and after waking the engine generates as before."""
    path, _ = checkpoints["qwen2"]
    engine = _engine(path)
    params = SamplingParams(temperature=0, max_tokens=MAX)
    before = engine.generate(PROMPTS, params)
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(torch.OutOfMemoryError, match="test"):
        engine.generate(PROMPTS, params)
    assert engine.scheduler.is_finished() and engine.block_manager.num_free_blocks == engine.kv_cache.num_blocks
    engine.sleep()
    monkeypatch.undo()
    engine.wake_up()
    assert engine.generate(PROMPTS, params).token_ids == before.token_ids


def test_sequence_too_long_for_the_cache_is_refused(checkpoints):
    path, _ = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="KV blocks"):
        _engine(path, num_kv_blocks=2).generate([list(range(1, 8))], SamplingParams(temperature=0, max_tokens=5))


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-0.1)])
def test_sampling_settings_out_of_range_are_refused(checkpoints, bad):
    """Settings outside their range fail before anything runs (top_p = 0 would leave the fused sampler's search no
    token to keep), as the config rules refuse them for `lathe train`."""
    path, _ = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="top_p must be in"):
        _engine(path).generate([[1, 2, 3]], SamplingParams(max_tokens=2, **bad))


@pytest.mark.parametrize("budget", [3, 5])
def test_chunked_prefill_equals_transformers(checkpoints, budget):
    """Prompts longer than the step's token budget are computed in chunks and still give transformers' tokens."""
    path, hf = checkpoints["qwen2"]
    engine = _engine(path, max_num_batched_tokens=budget)
    steps = []
    real_step = engine.scheduler.prefill_done

    def spy(seqs):
        steps.append([s.num_scheduled_tokens for s in seqs])
        return real_step(seqs)

    engine.scheduler.prefill_done = spy
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=MAX))
    assert out.token_ids == [_hf_greedy(hf, p, MAX) for p in PROMPTS for _ in range(2)]
    assert max(sum(s) for s in steps) <= budget and any(0 < n < 9 for s in steps for n in s)


def test_prompt_longer_than_budget_runs_alone_without_chunking(checkpoints):
    path, hf = checkpoints["llama"]
    engine = _engine(path, max_num_batched_tokens=4, enable_chunked_prefill=False)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    assert out.token_ids == [_hf_greedy(hf, p, MAX) for p in PROMPTS]


def test_gpu_sized_cache_is_capped_at_what_the_sequences_can_hold(checkpoints, monkeypatch):
    """A small model on a large GPU: the memory budget allows millions of blocks, but only max_num_seqs sequences
    of max_model_len tokens can ever be resident, so the cache (and the block manager's lists) stop there."""
    path, _ = checkpoints["qwen2"]
    engine = LatheEngine(load_lathe_model(path, torch.float32), eos_token_id=None, num_kv_blocks=8, max_model_len=64)
    config = engine.model.config
    monkeypatch.setattr(engine, "model", SimpleNamespace(config=config, device=torch.device("cuda"),
                                                         dtype=torch.float32))
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: gib)
    assert engine._default_num_blocks(16, 0.5, 32) == (64 // 16) * 32
    per_block = engine.kv_cache.bytes_per_block(config.num_hidden_layers, 16, config.num_key_value_heads,
                                                config.head_dim, torch.float32)
    small = 20 * per_block          # room for 20 blocks: the memory, not the cap, decides
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 40 * gib - small)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * gib - small)
    assert engine._default_num_blocks(16, 0.5, 32) == 20 - 1        # - the scratch block


def test_reserving_admission_prevents_a_preemption_storm(checkpoints):
    """A GRPO-shaped load (n samples per prompt, every response running to max_tokens) on a cache that holds a
    few full sequences: greedy admission takes every prompt that fits and then preempts as responses grow;
    reserving admission queues them instead. Seeded samples are the same either way."""
    path, _ = checkpoints["qwen2"]
    prompts = [[3 + i, 7, 11 + i, 5, 9][: 2 + i % 4] for i in range(8)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3, ignore_eos=True)
    greedy = _engine(path, num_kv_blocks=40, reserve_new_tokens=False)
    reserving = _engine(path, num_kv_blocks=40)
    storm, calm = greedy.generate(prompts, params), reserving.generate(prompts, params)
    assert calm.token_ids == storm.token_ids
    assert storm.metrics["rollout/num_preemptions"] >= 10
    assert calm.metrics["rollout/num_preemptions"] == 0
    assert reserving.scheduler.length_fraction == 1.0          # every response ran to max_tokens


def test_a_load_that_overflows_a_little_is_admitted_at_once(checkpoints, monkeypatch):
    """16 sequences whose responses at max_tokens need 84 blocks on a cache of 76: reserving in full holds some
    back for a second wave; the call plan (`OVERCOMMIT`) admits all, preempts the few that outgrow the cache near
    the end and takes fewer decode steps. Seeded samples are the same either way. With half the cache the plan
    keeps the full reservation (no preemption)."""
    from lathe.engine import scheduler
    path, _ = checkpoints["qwen2"]
    prompts = [[3 + i, 7, 11 + i, 5] for i in range(4)]         # one full block each: no copy-on-write block
    params = SamplingParams(n=4, temperature=1.0, max_tokens=20, seed=5, ignore_eos=True)
    runs = {}
    for name, overcommit, blocks in (("full", 1.0, 76), ("plan", scheduler.OVERCOMMIT, 76),
                                     ("small", scheduler.OVERCOMMIT, 40)):
        monkeypatch.setattr(scheduler, "OVERCOMMIT", overcommit)
        engine = _engine(path, num_kv_blocks=blocks)
        out = engine.generate(prompts, params)
        runs[name] = (out.token_ids, out.metrics["rollout/num_preemptions"], engine.scheduler.num_steps["decode"])
    (full, full_pre, full_steps), (plan, plan_pre, plan_steps), (small, small_pre, _) = runs.values()
    assert plan == full == small
    assert full_pre == 0 and small_pre == 0
    assert plan_pre > 0
    assert plan_steps < full_steps


def test_length_estimate_follows_finished_responses_and_preemption_raises_it(checkpoints):
    path, _ = checkpoints["qwen2"]
    engine = _engine(path, num_kv_blocks=40)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=0,
                                                  stop_token_ids=list(range(engine.model.config.vocab_size // 2))))
    assert any(len(t) < 16 for t in out.token_ids), "half the vocabulary stops: responses end early"
    assert engine.scheduler.length_fraction < 1.0
    low = engine.scheduler.expected_fraction
    engine.scheduler.preempt(_running_sequence(engine))
    assert engine.scheduler.expected_fraction == min(1.0, low + 0.25)
    engine.scheduler.new_call()
    assert engine.scheduler.expected_fraction == 1.0, "each call starts from nothing known (resume-exact batching)"


def _running_sequence(engine):
    from lathe.engine.sequence import Sequence, SequenceParams
    seq = Sequence([1, 2, 3], SequenceParams(max_tokens=4), None)
    engine.block_manager.allocate(seq)
    return seq


@pytest.mark.parametrize("case", ["stops", "preempt", "chunked"])
def test_overlapped_scheduling_equals_step_by_step(checkpoints, case, monkeypatch):
    """The engine runs each step while the host handles the previous step's tokens (a sequence's last token may
    still be on the device when the next step is scheduled). Token for token, it samples what resolving every
    step at once samples: with early stops (half the vocabulary stops), preemption, chunked prefill, top-k/p."""
    from lathe.engine.model_runner import ModelRunner
    path, _ = checkpoints["qwen2"]
    vocab = load_lathe_model(path).config.vocab_size
    kw = {"stops": {}, "preempt": dict(num_kv_blocks=12, reserve_new_tokens=False),
          "chunked": dict(max_num_batched_tokens=5)}[case]
    params = SamplingParams(n=3, temperature=0.9, top_k=40, top_p=0.95, max_tokens=12, min_tokens=2, seed=5,
                            stop_token_ids=list(range(0, vocab, 3 if case == "stops" else 7)))
    pending_steps = []
    take = ModelRunner.take_pending
    monkeypatch.setattr(ModelRunner, "take_pending",
                        staticmethod(lambda ids, pending: (pending_steps.append(pending is not None), take(ids, pending))))
    step_by_step = _engine(path, async_scheduling=False, **kw).generate(PROMPTS, params)
    assert not any(pending_steps)
    engine = _engine(path, async_scheduling=True, **kw)       # (the default on CUDA only)
    overlapped = engine.generate(PROMPTS, params)
    assert any(pending_steps), "decode steps took their inputs from the device"
    assert overlapped.token_ids == step_by_step.token_ids
    assert overlapped.finish_reasons == step_by_step.finish_reasons
    assert_close_rel(torch.tensor([x for row in overlapped.logprobs for x in row]),
                     torch.tensor([x for row in step_by_step.logprobs for x in row]), name="log-probs")
    if case == "stops":
        assert "stop" in overlapped.finish_reasons and any(len(t) < 12 for t in overlapped.token_ids)
    if case == "preempt":
        assert overlapped.metrics["rollout/num_preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(min(t) >= 0 for t in overlapped.token_ids if t), "no placeholder is left"


def test_blocks_completed_by_overlapped_tokens_are_keyed_for_reuse(checkpoints):
    """A generated token reaches the host a step late; the block it completes is keyed then, so a later prompt
    that continues the conversation reuses the generated blocks."""
    path, _ = checkpoints["qwen2"]
    engine = _engine(path, async_scheduling=True)
    prompt = PROMPTS[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    follow = prompt + out.token_ids[0] + [5]
    from lathe.engine.sequence import Sequence
    seq = Sequence(follow)
    engine.block_manager.allocate(seq)
    assert seq.num_kv_cached == (len(prompt) + MAX - 1) // 4 * 4      # every full block (the last token's KV
    engine.block_manager.deallocate(seq)                              # was never computed)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "overlapped"])
def test_a_stop_token_that_fills_a_block_is_not_reused_without_its_kv(checkpoints, async_scheduling):
    """A response that stops on a token filling a KV block: that token's KV is never computed (the sequence ends
    before feeding it), so its block must not be keyed for reuse. The next turn of a conversation continues it
    (prompt + response + more) and must compute that token, not read an unwritten slot: its greedy tokens and
    log-probs equal an engine without prefix caching."""
    path, _ = checkpoints["qwen2"]
    prompt = PROMPTS[0]                                      # 11 tokens, blocks of 4
    free = _engine(path, async_scheduling=async_scheduling).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids[0]
    j = next(j for j in range(len(free)) if (len(prompt) + j + 1) % 4 == 0 and free[j] not in free[:j])
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[j]])
    follow = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for caching in (True, False):
        engine = _engine(path, async_scheduling=async_scheduling, enable_prefix_caching=caching)
        first = engine.generate([prompt], stop).token_ids[0]
        assert first == free[:j + 1], "precondition: the response stops on the block-filling token"
        outs.append(engine.generate([prompt + first + [5, 6, 7]], follow))
    (cached, plain) = outs
    assert cached.token_ids == plain.token_ids
    assert_close_rel(cached.logprobs, plain.logprobs, rel=1e-5, name="next turn's log-probs")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "overlapped"])
def test_samples_fork_when_prefix_caching_is_off(checkpoints, async_scheduling, monkeypatch):
    """With prefix caching off (as several of verl's scripts ask) a prompt's `n` samples still share its prefill:
    they fork from the first once its prompt is computed (`Scheduler`), and sample what each one prefilling its own
    prompt samples (seeded, with stop tokens, chunked prefill); with prefix caching on the cache shares it instead."""
    path, _ = checkpoints["qwen2"]
    params = SamplingParams(n=3, temperature=0.9, max_tokens=MAX, seed=2, stop_token_ids=[5, 17, 40])
    outs, computed = {}, {}
    for fork in (False, True):
        engine = _engine(path, enable_prefix_caching=False, async_scheduling=async_scheduling,
                         max_num_batched_tokens=7)
        assert engine.fork_samples
        engine.fork_samples = fork
        computed[fork], prefill = [], engine.runner.prefill
        monkeypatch.setattr(engine.runner, "prefill", lambda seqs, num_new, c=computed[fork], p=prefill:
                            c.append(sum(num_new)) or p(seqs, num_new))
        outs[fork] = engine.generate(PROMPTS, params)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert "stop" in outs[True].finish_reasons and outs[True].token_ids == outs[False].token_ids
    assert outs[True].finish_reasons == outs[False].finish_reasons
    assert_close_rel(sum(outs[True].logprobs, []), sum(outs[False].logprobs, []), name="log-probs")
    assert sum(computed[True]) * 3 == sum(computed[False]) == 3 * sum(len(p) for p in PROMPTS)
    assert [outs[f].metrics["rollout/prefill_tokens"] for f in (True, False)] == [sum(computed[True]),
                                                                                 sum(computed[False])]
    assert not _engine(path).fork_samples


class _SlowEvent:
    """A CUDA event's stand-in whose device takes `seconds` to reach it; counts the waits."""

    def __init__(self, seconds: float):
        self.seconds, self.waits = seconds, 0

    def synchronize(self) -> None:
        self.waits += 1
        time.sleep(self.seconds)


def test_the_hosts_wait_for_sampled_tokens_is_reported_per_call(checkpoints, monkeypatch):
    """`timing_s/rollout_device_wait`: each step's wait for its tokens (the event's synchronize, once a step), summed
    over the call; on the CPU, where the host computes each step itself, 0."""
    from lathe.engine import llm_engine
    path, _ = checkpoints["qwen2"]
    engine = _engine(path, async_scheduling=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    out = engine.generate(PROMPTS, params)
    assert out.metrics["timing_s/rollout_device_wait"] == 0.0
    made = llm_engine._InFlight.__init__
    steps = []

    def with_event(self, seqs, sampled):
        made(self, seqs, sampled)
        self.host, self.event = self.out, _SlowEvent(0.002)
        steps.append(self)
    monkeypatch.setattr(llm_engine._InFlight, "__init__", with_event)
    again = engine.generate(PROMPTS, params)
    assert again.token_ids == out.token_ids
    assert len(steps) >= MAX and all(step.event.waits == 1 for step in steps)
    waited = again.metrics["timing_s/rollout_device_wait"]
    assert waited >= 0.002 * len(steps) and engine.device_wait_s == waited      # (sleep waits at least that long)
