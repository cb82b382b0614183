"""Speculative decoding with MTP drafts (lathe.engine.speculative, mtp_draft, spec_step) on a tiny random MiMo (CPU,
fp32): exact acceptance against a float64 reference, greedy output equal to the non-speculative engine's token for
token, the target's log-probs, preemption, prefix caching, chunked prefill, stop ids and max_tokens, streamed requests
with an interrupt, and a perfect draft layer accepting everything."""

import itertools

import numpy as np
import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.engine.speculative import accept_drafts
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel

from .conftest import PROMPTS


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(checkpoint path, transformers Qwen2 model of its main body)."""
    from models.mimo_tiny import save_mimo
    return save_mimo(tmp_path_factory.mktemp("mimo-spec"), layers=1)


def _engine(path, k, model=None, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_kv_blocks", 64)
    model = model if model is not None else load_lathe_model(path, torch.float32)
    return LatheEngine(model, eos_token_id=kw.pop("eos", None), num_speculative_tokens=k, **kw)


def _perfect_draft(path):
    """A MiMo whose next token depends on the current token only (the main layers' output projections are zero:
    h_t = norm(embed(x_t))) and whose MTP layer computes exactly that for the token it reads (input_proj keeps the
    embedding half; its attention and MLP add nothing; its final norm is the main one): every greedy draft is the
    target's greedy token."""
    model = load_lathe_model(path, torch.float32)
    inner = model.model
    with torch.no_grad():
        for layer in [*inner.layers, *inner.mtp_layers]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        mtp = inner.mtp_layers[0]
        h = model.config.hidden_size
        mtp.input_proj.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1))
        mtp.token_layernorm.weight.fill_(1.0)
        mtp.final_layernorm.weight.copy_(inner.norm.weight)
    return model


# ---- the acceptance rule -------------------------------------------------------------------------------------------


def _cells(points):
    """Midpoints and widths of the intervals [0, 1) is cut into at `points` (float64)."""
    edges = np.unique(np.clip(np.concatenate([[0.0, 1.0], np.asarray(points, dtype=np.float64)]), 0, 1))
    return (edges[:-1] + edges[1:]) / 2, np.diff(edges)


def test_accept_drafts_output_distribution_is_the_targets_exactly():
    """Two drafts over a 5-token vocabulary, a sampled row and a greedy (one-hot) row: the probability of each
    outcome (accepted drafts, emitted token) integrated exactly over the three positions' uniforms (accept_drafts is
    piecewise constant in them: the cells between each position's CDF values) equals standard speculative sampling's,
    in float64 (module doc of lathe.engine.speculative); so does each emitted position's marginal, the target's p."""
    gen = torch.Generator().manual_seed(0)
    v, k = 5, 2
    sampled = torch.softmax(torch.randn(k + 1, v, generator=gen, dtype=torch.float64) * 1.5, -1)
    greedy = torch.zeros(k + 1, v, dtype=torch.float64)
    greedy[torch.arange(k + 1), torch.tensor([3, 1, 4])] = 1.0
    for probs, drafts in [(sampled, [2, 0]), (sampled, [int(sampled[0].argmax()), int(sampled[1].argmax())]),
                          (greedy, [3, 2]), (greedy, [3, 1])]:
        p = probs.numpy()
        d = drafts
        cells = [_cells(np.cumsum(p[j])) for j in range(k + 1)]
        grid = np.array(list(itertools.product(*(range(len(c[0])) for c in cells))))
        weight = np.prod([cells[j][1][grid[:, j]] for j in range(k + 1)], axis=0)
        b = len(grid)
        n, tok = accept_drafts(probs.expand(b, k + 1, v), torch.tensor([d] * b), torch.full((b,), k),
                               torch.tensor(np.stack([cells[j][0][grid[:, j]] for j in range(k + 1)], 1)))
        got = np.zeros((k + 1, v))
        np.add.at(got, (n.numpy(), tok.numpy()), weight)
        want = np.zeros((k + 1, v))         # P(n accepted, token x): accept d with p(d), else the residual
        reach = 1.0
        for j in range(k):
            rest = 1 - p[j, d[j]]
            if rest > 0:
                want[j] = reach * rest * np.where(np.arange(v) == d[j], 0, p[j]) / rest
            reach *= p[j, d[j]]
        want[k] = reach * p[k]
        assert_close_rel(got, want, 1e-12, "P(accepted, token)")
        # the first emitted token is distributed as p_0
        first = got[0].copy()
        first[d[0]] += got[1:].sum()
        assert_close_rel(first, p[0], 1e-12, "first token's marginal")


def test_accept_drafts_respects_num_drafts_and_draws_as_the_sampler():
    probs = torch.tensor([[[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]])
    # no draft: the token is drawn from p_0 (inverse CDF at 0.5 -> token 1)
    n, tok = accept_drafts(probs, torch.tensor([[-1]]), torch.tensor([0]), torch.tensor([[0.5, 0.5]]))
    assert n.tolist() == [0] and tok.tolist() == [1]
    # p_0(d) = 1: always accepted, then the bonus from p_1
    n, tok = accept_drafts(probs, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.999, 0.9]]))
    assert n.tolist() == [1] and tok.tolist() == [2]
    # a rejected draft: the emitted token is the position's own draw (what the plain sampler draws there)
    n, tok = accept_drafts(probs[:, [1, 1]], torch.tensor([[2]]), torch.tensor([1]), torch.tensor([[0.3, 0.9]]))
    assert n.tolist() == [0] and tok.tolist() == [1]


# ---- the engine ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_non_speculative_with_prefix_caching_and_chunks(mimo, k):
    """Several prompts (two sharing a prefix of two blocks), n=2 each, a small prefill budget (prompts in chunks):
    the speculative engine's greedy tokens, finish reasons and log-probs are the plain engine's."""
    path, _ = mimo
    params = SamplingParams(n=2, temperature=0, max_tokens=11)
    base = _engine(path, 0, max_num_batched_tokens=6).generate(PROMPTS, params)
    spec = _engine(path, k, max_num_batched_tokens=6).generate(PROMPTS, params)
    assert spec.token_ids == base.token_ids
    assert spec.finish_reasons == base.finish_reasons
    assert_close_rel(spec.logprobs, base.logprobs, 1e-5, "log-probs")
    assert spec.metrics["rollout/spec_verify_steps"] > 0
    assert spec.metrics["rollout/spec_draft_tokens"] > 0


def test_stop_ids_and_max_tokens_cut_accepted_drafts_exactly(mimo):
    """With a perfect draft every draft is accepted, so a stop id or the length limit falls inside a verify step's
    accepted run: the output ends exactly where the plain engine's does."""
    path, _ = mimo
    model = _perfect_draft(path)
    plain = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64)
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    stop = free.token_ids[0][5]                         # a token of the first response, mid-way
    for max_tokens in (1, 2, 6, 9):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=[stop])
        base = plain.generate(PROMPTS, params)
        spec = _engine(path, 3, model=model).generate(PROMPTS, params)
        assert spec.token_ids == base.token_ids, max_tokens
        assert spec.finish_reasons == base.finish_reasons, max_tokens
    assert "stop" in base.finish_reasons and "length" in base.finish_reasons


def test_stop_strings_cut_accepted_drafts_exactly(tmp_path):
    """Stop strings (decoded text) inside a perfect draft's accepted runs: the plain engine's output, token for
    token."""
    from lathe.data.builtin import builtin_tokenizer
    from models.mimo_tiny import save_mimo
    tok = builtin_tokenizer()
    path, _ = save_mimo(tmp_path / "m", vocab_size=len(tok), tokenizer=tok)
    model = _perfect_draft(path)
    plain = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, tokenizer=tok)
    spec = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, tokenizer=tok,
                       num_speculative_tokens=3)
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in free.token_ids]
    stops = [t[5:7] for t in texts if len(t) > 8][:2]
    assert stops, "precondition: some output text"
    params = SamplingParams(temperature=0, max_tokens=16, stop=stops)
    want, got = plain.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert got.token_ids == want.token_ids and got.finish_reasons == want.finish_reasons
    assert "stop" in want.finish_reasons


def test_perfect_draft_takes_fewer_target_forwards_than_tokens(mimo):
    path, _ = mimo
    model = _perfect_draft(path)
    engine = _engine(path, 3, model=model)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=17))
    assert out.metrics["rollout/spec_accept_rate"] == 1.0
    assert out.metrics["rollout/spec_accept_length"] == 4.0             # k + 1 tokens per verify step
    assert engine.scheduler.num_steps["decode"] == 4                    # 16 tokens after the prefill's first
    plain = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64)
    assert out.token_ids == plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=17)).token_ids
    assert plain.scheduler.num_steps["decode"] == 16


@torch.no_grad()
def test_sampled_logprobs_are_the_targets_teacher_forced(mimo):
    """Sampling (temperature, top-k, top-p) with random drafts: each returned log-prob is the target model's
    log_softmax(logits / T) of the token, as a teacher-forced forward of prompt + response computes it."""
    path, hf = mimo
    engine = _engine(path, 2)
    temperature = 0.8
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=temperature, top_k=20, top_p=0.9, max_tokens=9,
                                                  seed=3))
    got, want = [], []
    for i, (ids, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        prompt = PROMPTS[i // 2]
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double() / temperature
        want.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0])
        got.append(torch.tensor(lps, dtype=torch.float64))
    assert_close_rel(torch.cat(got), torch.cat(want), 1e-5, "log-probs")
    assert len({tuple(t) for t in out.token_ids}) > 4, "precondition: the samples differ"


def test_sampling_with_a_perfect_draft_is_reproducible_and_accepts(mimo):
    """The same seed samples the same tokens whatever the batch (one prompt alone or with the others)."""
    path, _ = mimo
    model = _perfect_draft(path)
    params = SamplingParams(n=2, temperature=0.7, max_tokens=10, seed=5)
    both = _engine(path, 3, model=model).generate(PROMPTS, params)
    alone = _engine(path, 3, model=model).generate(PROMPTS[2:3], params, first_index=4)
    assert alone.token_ids == both.token_ids[4:6]
    assert both.metrics["rollout/spec_accepted_tokens"] > 0


def test_sampled_tokens_do_not_depend_on_preemption_or_drafts(mimo):
    """Sampling with a sharpened perfect draft (most drafts accepted, runs of accepted drafts and bonus tokens): the
    same seed samples the same tokens with a roomy cache, with a cache small enough to preempt (a readmitted sequence
    resumes mid-response), and in the non-speculative engine (each emitted token is its position's inverse-CDF draw,
    whatever the drafts: `accept_drafts`)."""
    path, _ = mimo
    model = _perfect_draft(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=14, seed=7)
    plain = _engine(path, 0, model=model).generate(PROMPTS, params)
    roomy = _engine(path, 2, model=model).generate(PROMPTS, params)
    tight = _engine(path, 2, model=model, num_kv_blocks=14, reserve_new_tokens=False).generate(PROMPTS, params)
    assert tight.metrics["rollout/num_preemptions"] > 0 and roomy.metrics["rollout/spec_accept_rate"] > 0.2
    assert tight.token_ids == roomy.token_ids
    assert roomy.token_ids == plain.token_ids
    assert_close_rel(roomy.logprobs, plain.logprobs, 1e-5, "log-probs")


def test_preemption_recomputes_and_matches(mimo):
    path, _ = mimo
    params = SamplingParams(n=2, temperature=0, max_tokens=14)
    base = _engine(path, 0).generate(PROMPTS, params)
    engine = _engine(path, 2, num_kv_blocks=14, reserve_new_tokens=False)
    out = engine.generate(PROMPTS, params)
    assert out.metrics["rollout/num_preemptions"] > 0
    assert out.token_ids == base.token_ids
    assert_close_rel(out.logprobs, base.logprobs, 1e-5, "log-probs")


def test_streamed_requests_with_an_interrupt_and_weight_load(mimo):
    """Partial rollout: interrupted mid-decode, the same weights loaded again (the MTP layers' tensors among them),
    continued: the tokens are the uninterrupted greedy run's."""
    path, _ = mimo
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    base = _engine(path, 0).generate(PROMPTS, params)
    engine = _engine(path, 2)
    engine.add_request("r", PROMPTS, params)
    for _ in range(4):
        engine.step()
    assert engine.interrupt() > 0
    state = list(load_lathe_model(path, torch.float32).state_dict().items())
    assert any(name.startswith("model.mtp_layers.") for name, _ in state)
    engine.load_weights(state, version=1)
    done = {}
    while engine.has_unfinished_requests():
        engine.step()
        done.update(engine.pop_finished())
    done.update(engine.pop_finished())
    assert done["r"].token_ids == base.token_ids
    assert "rollout/spec_accept_rate" in done["r"].metrics


def test_prefix_hit_tokens_count_the_cached_prompt_tokens(mimo):
    """A prompt streamed twice: the second finds its two full blocks in the prefix cache, and
    rollout/prefix_hit_tokens (the agent loop's agent/prefix_hit_rate) counts them as the plain engine does, though the
    speculative engine recomputes the last one's hidden state (`BlockManager.hit_overlap`)."""
    path, _ = mimo
    model = load_lathe_model(path, torch.float32)
    for k in (0, 2):
        engine = _engine(path, k, model=model)
        for request in range(2):
            engine.add_request(request, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
            done = {}
            while engine.has_unfinished_requests():
                engine.step()
                done.update(engine.pop_finished())
        assert done[1].metrics["rollout/prefix_hit_tokens"] == 8, k


def test_refusals(mimo, tmp_path):
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        _engine(path, 2)
    with pytest.raises(ValueError, match="rollout.quantization=fp8"):
        _engine(mimo[0], 2, quantization="fp8")
    with pytest.raises(ValueError, match="enable_rollout_routing_replay"):
        _engine(mimo[0], 2, record_routing=True)


@pytest.mark.parametrize("setting", [dict(max_num_batched_tokens=6), dict(num_kv_blocks=14, reserve_new_tokens=False)])
@torch.no_grad()
def test_first_drafts_are_the_mtp_layers_prediction(mimo, setting):
    """Each verify step's first draft is the argmax of MTP layer 0 at the position before the last committed token,
    as the trainer's packed MTP forward (`lathe.models.mtp.mtp_stream`) computes it over the committed tokens: the
    draft cache's entries are right under prefix caching (n=2, shared prompt blocks), chunked prefill and preemption
    (recomputed at readmission)."""
    from lathe.models.attention import PackedAttention
    from lathe.models.mtp import mtp_stream
    path, _ = mimo
    engine = _engine(path, 2, **setting)
    seen = []
    draft = engine._draft

    def recording(seqs, ks):
        out = draft(seqs, ks)
        seen.extend((list(s.token_ids), d[0]) for s, d in zip(seqs, out) if d)
        return out
    engine._draft = recording
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=12))
    if "reserve_new_tokens" in setting:
        assert out.metrics["rollout/num_preemptions"] > 0
    model = engine.model
    for tokens, first in seen:
        ids = torch.tensor(tokens)
        n = len(tokens)
        pos, cu = torch.arange(n), torch.tensor([0, n], dtype=torch.int32)
        hidden = model.forward_packed(ids, pos, cu, n)
        mtp = mtp_stream(model, hidden, ids, pos, cu, PackedAttention(cu, n, model.packed_backend()))[0]
        assert int(model.lm_head(mtp[n - 2]).argmax()) == first
    assert len(seen) > 20


def test_wake_up_budget_counts_the_draft_cache(mimo, monkeypatch):
    """`wake_up` takes the kept cache back only while `gpu_memory_utilization` holds it (`_blocks_within_utilization`):
    the blocks it allows, each with its main and its draft-layer entries (the scratch block too), fit the budget; and
    rollout/kv_cache_gb reports both caches."""
    from lathe.engine import llm_engine
    from lathe.engine.kv_cache import KVCache
    from lathe.engine.mtp_draft import MtpDrafter
    engine = _engine(mimo[0], 2)
    total, allocated, utilization = 1 << 30, 100 << 20, 0.5
    monkeypatch.setattr(llm_engine.accel, "total_memory", lambda device: total)
    monkeypatch.setattr(llm_engine.accel, "memory_allocated", lambda device: allocated)
    engine._auto_size = (4, utilization, 8)
    blocks = engine._blocks_within_utilization()
    per_block = engine.kv_cache.nbytes // engine.kv_cache.shape[0] + MtpDrafter.bytes_per_block(engine.model, 4)
    assert per_block > engine.kv_cache.nbytes // engine.kv_cache.shape[0] == KVCache.bytes_per_block(
        engine.kv_cache.num_layers, 4, *engine.kv_cache.shape[2:], engine.kv_dtype)
    assert (blocks + 1) * per_block <= total * utilization - allocated < (blocks + 2) * per_block
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))       # (the draft cache too)
    assert out.metrics["rollout/kv_cache_gb"] * 2**30 == engine.kv_cache.nbytes + engine.drafter.cache.nbytes


def test_wake_up_recovers_when_the_kept_memory_does_not_hold_the_draft_cache(mimo):
    """`sleep` kept the allocator's memory (`_cache_kept`) and the main cache fits back there, the draft layer's cache
    does not (out of memory): as when the main cache does not fit, both are released and taken again, and the engine
    generates."""
    engine = _engine(mimo[0], 2)
    params = SamplingParams(temperature=0, max_tokens=6)
    want = engine.generate(PROMPTS, params).token_ids
    engine.sleep()
    engine._cache_kept = True
    cache, calls = engine.drafter.cache, []
    allocate = cache.allocate

    def once_out_of_memory():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("test: the allocator's cached memory is spent")
        allocate()
    cache.allocate = once_out_of_memory
    engine.wake_up()
    assert len(calls) == 2 and cache.allocated and cache.shape[0] == engine.kv_cache.shape[0]
    assert engine.generate(PROMPTS, params).token_ids == want


# ---- tensor-parallel replicas --------------------------------------------------------------------------------------


def _replica_model(path, tp, device):
    from lathe.engine.tensor_parallel import shard_copy
    model = load_lathe_model(path, torch.float32, device=device)
    return model if tp is None else shard_copy(model, torch.float32, device, tp, keep_mtp=True)


def _replica_generations(model, path):
    """Greedy and sampled speculative generations, and greedy again after new weights (the MTP layers' changed too:
    their drafts, and so the steps, change with them)."""
    engine = LatheEngine(model, eos_token_id=None, block_size=4, num_kv_blocks=64, max_model_len=48,
                         num_speculative_tokens=2)
    out = [engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=10)).token_ids,
           engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=10, seed=3)).token_ids]
    whole = load_lathe_model(path, torch.float32)
    engine.update_weights((n, t * 1.1 if t.dim() == 2 else t + 0.05) for n, t in whole.state_dict().items())
    out.append(engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=10)).token_ids)
    return out


def test_a_tensor_parallel_replica_drafts_and_verifies_as_one_process(mimo):
    """Two gloo ranks, the MTP layer whole on each (`shard_copy(keep_mtp=True)`), weights updated by whole HF names:
    the tokens one process generates."""
    from engine.test_tensor_parallel import run_replica
    path = str(mimo[0])
    want = _replica_generations(_replica_model(path, None, torch.device("cpu")), path)
    results = run_replica(2, [path], make=_replica_model, generate=_replica_generations)
    for rank, (got,) in results.items():
        assert got == want, f"rank {rank}"


def test_acceptance_metrics_merge_per_response():
    """Two replicas' (or rounds', requests') metrics: totals summed, per-response means weighted by responses."""
    from lathe.cluster.roles import merge_rollout_metrics
    from lathe.engine.speculative import SAMPLES
    a = {"rollout/spec_accept_rate": 0.5, "rollout/spec_accept_length": 2.0, "rollout/spec_verify_steps": 10.0,
         "rollout/spec_draft_tokens": 30.0, "rollout/spec_accepted_tokens": 15.0, SAMPLES: 2.0,
         "rollout/num_preemptions": 1}
    b = {"rollout/spec_accept_rate": 0.2, "rollout/spec_accept_length": 1.4, "rollout/spec_verify_steps": 5.0,
         "rollout/spec_draft_tokens": 15.0, "rollout/spec_accepted_tokens": 3.0, SAMPLES: 6.0,
         "rollout/num_preemptions": 2}
    out = merge_rollout_metrics([a, b])
    assert out["rollout/spec_accept_rate"] == pytest.approx((0.5 * 2 + 0.2 * 6) / 8)
    assert out["rollout/spec_accept_length"] == pytest.approx((2.0 * 2 + 1.4 * 6) / 8)
    assert out["rollout/spec_verify_steps"] == 15 and out[SAMPLES] == 8 and out["rollout/num_preemptions"] == 3


@pytest.mark.gpu
def test_on_cuda_greedy_equals_the_plain_engine_with_graphs_and_a_sleep(mimo):
    """CUDA, fp32: the speculative engine (compiled main layers, fused projections, eager steps, the fused sampler at
    prefill) gives the greedy tokens of the plain engine with its decode graphs and overlapped scheduling; again after
    a sleep and wake-up (both caches freed and taken back); sampled log-probs stay the target's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, hf = mimo
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    plain = LatheEngine.from_pretrained(path, eos_token_id=None, device="cuda", block_size=4, num_kv_blocks=64)
    want = plain.generate(PROMPTS, params)
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, device="cuda", block_size=4, num_kv_blocks=64,
                                         num_speculative_tokens=3)
    assert engine.generate(PROMPTS, params).token_ids == want.token_ids
    engine.sleep()
    engine.wake_up()
    assert engine.generate(PROMPTS, params).token_ids == want.token_ids
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, top_p=0.9, max_tokens=9, seed=1))
    got, ref = [], []
    with torch.no_grad():
        for i, (ids, lps) in enumerate(zip(out.token_ids, out.logprobs)):
            prompt = PROMPTS[i // 2]
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double() / 0.9
            ref.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0])
            got.append(torch.tensor(lps, dtype=torch.float64))
    assert_close_rel(torch.cat(got), torch.cat(ref), 1e-4, "log-probs")
