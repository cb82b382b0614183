"""Tests for lathe.engine.stream: streamed requests and partial rollout (interrupt + load_weights), CPU fp32.

The model is a tiny random lathe decoder built in code; two seeds give the weights A and B of a weight sync.
"""

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models.config import LatheConfig
from lathe.models.decoder import LatheCausalLM, init_weights

from helpers import assert_close_rel

VOCAB = 97
P0, P1, P2, P3 = [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 8], [1, 2, 3, 4, 5, 6, 7, 40, 41, 42], [20, 21, 22, 23, 24]
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def _model(seed: int) -> LatheCausalLM:
    cfg = LatheConfig(architecture="Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=128, qkv_bias=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LatheCausalLM(cfg)
        init_weights(model, std=0.3)         # large weights: peaked, prompt-dependent distributions
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def weights():
    return {"A": _model(0), "B": _model(1)}


def _engine(model, device="cpu", **kw) -> LatheEngine:
    copy = _model(99)
    copy.load_state_dict(model.state_dict())
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 128)
    return LatheEngine(copy.to(device), eos_token_id=None, **kw)


@torch.no_grad()
def _teacher_forced(model, prompt, response):
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _run(engine, steps=None, log=None):
    """Step until idle (or `steps` steps), popping after each step; returns {id: output}."""
    done, n = {}, 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        engine.step()
        n += 1
        for rid, out in engine.pop_finished():
            assert rid not in done, f"request {rid} returned twice"
            done[rid] = out
            if log is not None:
                log.append(rid)
    return done


def _same(out, ref, rel=1e-5):
    """Same tokens and stops; log-probs within `rel` (on CUDA another batch composition picks other kernels)."""
    assert out.token_ids == ref.token_ids
    assert out.finish_reasons == ref.finish_reasons
    assert_close_rel([x for r in out.logprobs for x in r], [x for r in ref.logprobs for x in r], rel=rel,
                     name="log-probs")


REQUESTS = {     # id: (prompts, params, first_index, added after this many steps)
    "greedy": ([P0, P1], SamplingParams(n=2, temperature=0, max_tokens=10), 0, 0),
    "sampled": ([P2], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7), 4, 0),
    "top_p": ([P3, P1], SamplingParams(n=2, temperature=1.0, top_p=0.8, max_tokens=9, seed=7), 10, 3),
    "late": ([P0], SamplingParams(n=2, temperature=1.0, max_tokens=7, seed=3,
                                  stop_token_ids=list(range(0, VOCAB, 5))), 2, 6),
}


@pytest.mark.parametrize("async_scheduling", MODES)
def test_streamed_requests_equal_one_generate_call_each(weights, async_scheduling):
    engine = _engine(weights["A"], async_scheduling=async_scheduling)
    done, steps = {}, 0
    pending = dict(REQUESTS)
    while pending or engine.has_unfinished_requests():
        for rid, (prompts, params, first, at) in list(pending.items()):
            if at <= steps:
                engine.add_request(rid, prompts, params, first_index=first)
                del pending[rid]
        engine.step()
        steps += 1
        done.update(engine.pop_finished())
    assert set(done) == set(REQUESTS)
    ref = _engine(weights["A"])
    for rid, (prompts, params, first, _) in REQUESTS.items():
        _same(done[rid], ref.generate(prompts, params, first_index=first))
        assert done[rid].versions == [[(0, 0)]] * len(prompts) * params.n
        assert done[rid].metrics["rollout/num_preemptions"] == 0
        assert done[rid].metrics["rollout/num_interrupted"] == 0
    assert "stop" in done["late"].finish_reasons or any(len(t) < 7 for t in done["late"].token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_streamed_requests_survive_memory_preemption(weights):
    """A cache too small for every sequence at once preempts (counted per request); samples are unchanged."""
    engine = _engine(weights["A"], num_kv_blocks=14, reserve_new_tokens=False)
    for rid, (prompts, params, first, _) in REQUESTS.items():
        engine.add_request(rid, prompts, params, first_index=first)
    done = _run(engine)
    ref = _engine(weights["A"])
    for rid, (prompts, params, first, _) in REQUESTS.items():
        _same(done[rid], ref.generate(prompts, params, first_index=first))
    assert sum(o.metrics["rollout/num_preemptions"] for o in done.values()) == engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", MODES)
def test_pop_finished_returns_each_request_once_in_finish_order(weights, async_scheduling):
    engine = _engine(weights["A"], async_scheduling=async_scheduling)
    lengths = {"a": 6, "b": 2, "c": 9, "d": 4}
    for rid, m in lengths.items():
        engine.add_request(rid, [P0, P3], SamplingParams(n=2, temperature=1.0, max_tokens=m, seed=1))
    engine.add_request("empty", [P1], SamplingParams(n=2, max_tokens=0))
    with pytest.raises(ValueError, match="already"):
        engine.add_request("a", [P1], SamplingParams(max_tokens=3))
    assert engine.pop_finished()[0][1].token_ids == [[], []]      # nothing to generate: done at once
    seen = []
    done = {}
    while engine.has_unfinished_requests():
        engine.step()
        for rid, out in engine.pop_finished():
            assert all(len(t) == lengths[rid] for t in out.token_ids), "returned only once all n samples are done"
            seen.append(rid)
            done[rid] = out
    assert seen == ["b", "d", "a", "c"]
    assert engine.pop_finished() == [] and not engine.has_unfinished_requests()
    engine.add_request("a", [P1], SamplingParams(temperature=0, max_tokens=3))       # returned: the id is free again
    assert [rid for rid, _ in _run_pop(engine)] == ["a"]
    engine.add_request("x", [P1], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RuntimeError, match="streamed"):
        engine.generate([P0], SamplingParams(max_tokens=3))
    while not engine.scheduler.is_finished():       # x's last token may still be on the device (async)
        engine.step()
    assert engine.generate([P0], SamplingParams(temperature=0, max_tokens=3)).token_ids[0]
    [(rid, out)] = engine.pop_finished()
    assert rid == "x" and out.token_ids == [_greedy3(weights["A"], [P1])]


def _greedy3(model, prompts):
    return _engine(model).generate(prompts, SamplingParams(temperature=0, max_tokens=3)).token_ids[0]


def _run_pop(engine):
    while engine.has_unfinished_requests():
        engine.step()
    return engine.pop_finished()


PARTIAL = {"r0": ([P0], SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3), 0),
           "r1": ([P1], SamplingParams(temperature=0, max_tokens=3), 2),
           "r2": ([P2, P3], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=3), 5)}
LATE = ([P3], SamplingParams(n=2, temperature=0, max_tokens=6), 0)       # added during the sync: waits through it
K = 5                                         # steps before the interrupt: one prefill, then decodes (K tokens each)


def _partial_rollout(engine, B, *, sleep=False) -> dict:
    for rid, (prompts, params, first) in PARTIAL.items():
        engine.add_request(rid, prompts, params, first_index=first)
    done = _run(engine, steps=K)
    assert list(done) == ["r1"]
    engine.add_request("r3", *LATE[:2])
    assert engine.interrupt() == 4                  # r0's two samples, r2's two
    assert not engine.scheduler.running and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if sleep:
        engine.sleep()
        engine.wake_up()
    named = list(B.state_dict().items())
    for bucket in (named[:4], named[4:]):           # a sync may load its tensors bucket by bucket
        engine.load_weights(bucket, version=1)
    assert engine.weight_version == 1 and not engine.block_manager.hash_to_block
    done.update(_run(engine))
    assert set(done) == {*PARTIAL, "r3"}
    return done


def _check_partial(done, A, B, ref_a, ref_b, rel):
    """(a) tokens before the switch are the uninterrupted A run's; (b) the version spans; (c) each span's log-probs
    are teacher-forced under its weights (prompt + all tokens, T=1); (d) interruptions are counted."""
    models, changed = {0: A, 1: B}, False
    for rid, (prompts, params, first) in {**PARTIAL, "r3": LATE}.items():
        out, uninterrupted = done[rid], ref_a.generate(prompts, params, first_index=first)
        interrupted = rid in ("r0", "r2")
        spans = {"r0": [(0, 0), (1, K)], "r2": [(0, 0), (1, K)], "r1": [(0, 0)], "r3": [(1, 0)]}[rid]
        assert out.versions == [spans] * len(out.token_ids)
        assert out.metrics["rollout/num_interrupted"] == (len(out.token_ids) if interrupted else 0)
        all_prompts = [p for p in prompts for _ in range(params.n)]
        for prompt, ids, lps, ref_ids in zip(all_prompts, out.token_ids, out.logprobs, uninterrupted.token_ids):
            assert len(ids) == len(lps) == params.max_tokens
            switch = next((start for version, start in spans if version == 1), len(ids))
            assert ids[:switch] == ref_ids[:switch], "tokens sampled before the interrupt are A's"
            changed |= ids[switch:] != ref_ids[switch:]
            for s, (version, start) in enumerate(spans):
                end = spans[s + 1][1] if s + 1 < len(spans) else len(ids)
                forced = _teacher_forced(models[version], prompt, ids)
                assert_close_rel(lps[start:end], forced[start:end], rel=rel, name=f"{rid} v{version} log-probs")
        if rid == "r3":       # started after the sync: B's own generate
            _same(out, ref_b.generate(prompts, params, first_index=first), rel=rel)
    assert changed, "precondition: B continues differently from A"


@pytest.mark.parametrize("mode", ["sync", "async", "async_sleep"])
def test_partial_rollout_continues_under_new_weights(weights, mode):
    A, B = weights["A"], weights["B"]
    done = _partial_rollout(_engine(A, async_scheduling=mode != "sync"), B, sleep=mode == "async_sleep")
    _check_partial(done, A, B, _engine(A), _engine(B), rel=1e-4)


@pytest.mark.gpu
def test_partial_rollout_on_cuda_with_graphs_and_overlap(weights):
    """The CUDA defaults: compiled layers, decode graphs, overlapped scheduling; interrupted mid-decode."""
    A, B = weights["A"], weights["B"]
    engine = _engine(A, "cuda")
    assert engine.async_scheduling and engine.runner.graphs is not None
    done = _partial_rollout(engine, B)
    assert engine.runner.graphs.captures > 0
    _check_partial(done, A, B, _engine(A, "cuda"), _engine(B, "cuda"), rel=1e-3)


def test_load_weights_refuses_while_kv_is_held_and_interrupt_when_idle(weights):
    engine = _engine(weights["A"])
    assert engine.interrupt() == 0 and engine.weight_version == 0
    engine.load_weights(weights["B"].state_dict().items(), version=4)       # idle: allowed
    assert engine.weight_version == 4
    engine.add_request("r", [P0, P1], SamplingParams(n=2, temperature=0, max_tokens=8))
    engine.step()
    engine.step()
    with pytest.raises(RuntimeError, match="interrupt"):
        engine.load_weights(weights["A"].state_dict().items(), version=5)
    with pytest.raises(RuntimeError, match="interrupt"):
        engine.sleep()
    assert engine.weight_version == 4
    out = dict(_run_pop(engine))["r"]
    _same(out, _engine(weights["B"]).generate([P0, P1], SamplingParams(n=2, temperature=0, max_tokens=8)))
    assert out.versions == [[(4, 0)]] * 4
    assert engine.interrupt() == 0


def test_interrupt_mid_prefill(weights):
    """A prompt computed in chunks is interrupted half-way: its KV goes too, and all its tokens are B's."""
    engine = _engine(weights["A"], max_num_batched_tokens=5)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=2)
    engine.add_request("r", [P0, P2], params)
    engine.step()
    assert engine.scheduler.prefilling is not None
    assert engine.interrupt() == 1 and engine.scheduler.prefilling is None
    engine.load_weights(weights["B"].state_dict().items(), version=1)
    out = dict(_run_pop(engine))["r"]
    _same(out, _engine(weights["B"]).generate([P0, P2], params))
    assert out.versions == [[(1, 0)]] * 2 and out.metrics["rollout/num_interrupted"] == 1
