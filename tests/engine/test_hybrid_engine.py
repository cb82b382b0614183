"""lathe's engine over the hybrid linear-attention families: Qwen3.5's greedy tokens equal transformers' generate
with preemption and chunked prefill in the run, Qwen3-Next's sampled log-probs equal a teacher-forced forward, an
interrupted partial rollout continues with the same tokens, and the state slots come back
(`lathe.engine.linear_state`)."""

import pytest
import torch

from lathe.engine.llm_engine import LatheEngine
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel

from .conftest import PROMPTS
from .test_llm_engine import MAX, _hf_greedy, _teacher_forced


def test_greedy_equals_transformers_generate_with_preemption_and_chunked_prefill(tmp_path):
    from models.lathe_tiny import save_hf
    path, hf = save_hf(tmp_path, "qwen3_5_text")
    expected = [tokens for p in PROMPTS for tokens in [_hf_greedy(hf, p, MAX)] * 2]
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"
    # a cache too small for every sequence at once (preemptions: recomputed from their tokens), prompts cut in
    # chunks of 3 tokens (a sequence continues from its states across prefill steps)
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=10,
                                         reserve_new_tokens=False, max_num_batched_tokens=3)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=MAX))
    assert out.token_ids == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.num_layers == 1
    assert engine.states.slot == {} and len(engine.states.free) == engine.scheduler.max_num_seqs
    assert not engine.block_manager.enable_prefix_caching


def test_log_probs_equal_teacher_forced_forward(tmp_path):
    """Qwen3-Next (fused projections by key head, MoE with a shared expert) sampling in the engine."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_next")
    model = load_lathe_model(path)
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    params = SamplingParams(n=2, temperature=0.7, max_tokens=MAX, seed=1)
    out = engine.generate(PROMPTS, params)
    for prompt, ids, lps in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.logprobs):
        assert_close_rel(lps, _teacher_forced(model, prompt, ids, 0.7), name="log-probs")


@pytest.mark.gpu
def test_greedy_on_cuda_equals_the_cpu_engine(tmp_path):
    """fla's kernels in the engine (chunked prefill, recurrent decode; fp32 on CUDA) give the CPU engine's greedy
    tokens (the CPU engine equals transformers' generate above; transformers itself is no reference here: with fla
    installed it calls fla's Triton kernels on CPU tensors too), and log-probs near its teacher-forced ones."""
    pytest.importorskip("fla")
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    cpu = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    expected = cpu.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, device="cuda", block_size=4, num_kv_blocks=64)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX))
    assert out.token_ids == expected.token_ids
    for got, want in zip(out.logprobs, expected.logprobs):
        assert_close_rel(got, want, rel=1e-2, name="CUDA vs CPU engine log-probs")     # fla's TF32 products


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_cuda_graph_decode_equals_eager_decode(tmp_path, family):
    """Decode steps replayed from CUDA graphs give the eager engine's greedy tokens, with preemptions (batches of 6
    and fewer: padding rows on the scratch slot): Qwen3.5 in fp32, Qwen3.5-MoE in bf16 (its experts are capturable
    only as grouped matmuls, bf16 on Hopper). After a sleep, the graphs are captured again exactly when the states
    or the cache came back elsewhere, and give the same tokens."""
    pytest.importorskip("fla")
    import torch

    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, family)
    bf16 = family == "qwen3_5_moe_text"
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    outs = {}
    for eager in (True, False):
        engine = LatheEngine.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32, device="cuda",
                                             eos_token_id=None, block_size=4, num_kv_blocks=14,
                                             reserve_new_tokens=False, enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager
        outs[eager] = engine.generate(PROMPTS[:3], params)
    assert outs[True].metrics["rollout/num_preemptions"] > 0
    assert outs[False].metrics["rollout/graph_captures"] > 0
    _assert_same_greedy(outs[False], outs[True], exact=not bf16)
    before = engine._addresses()
    engine.sleep()
    held = torch.empty(engine.states.shapes[0], dtype=engine.states.dtype, device="cuda")   # may take their block
    engine.wake_up()
    again = engine.generate(PROMPTS[:3], params)
    del held
    assert (again.metrics["rollout/graph_captures"] > 0) == (engine._addresses() != before)
    _assert_same_greedy(again, outs[True], exact=not bf16)


def _assert_same_greedy(got, want, exact: bool) -> None:
    """Equal greedy tokens and near log-probs; where not `exact` (bf16: the graph's padded batch and split decode
    attention round otherwise than the eager step), a sequence may part from the other at a near-tie only."""
    if exact:
        assert got.token_ids == want.token_ids
    for tokens, ref, lps, ref_lps in zip(got.token_ids, want.token_ids, got.logprobs, want.logprobs):
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), len(ref))
        assert same == len(ref) or abs(lps[same] - ref_lps[same]) < 0.05, \
            f"greedy tokens part at {same} where the eager step's choice is not a near-tie"
        assert_close_rel(lps[:same], ref_lps[:same], rel=1e-2 if exact else 5e-2, name="greedy log-probs")


def test_an_interrupted_partial_rollout_continues_with_the_same_tokens(tmp_path):
    """Partial rollout (fully async): interrupted mid-decode, the sequences give their state slots back and continue
    (recomputed from their tokens) with the tokens of an uninterrupted run."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=MAX, seed=3)
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    ref = engine.generate(PROMPTS, params).token_ids
    engine.add_request("r", PROMPTS, params)
    for _ in range(4):
        engine.step()
    assert engine.interrupt() > 0 and engine.states.slot == {}
    engine.load_weights(engine.model.state_dict().items(), version=1)
    while engine.has_unfinished_requests():
        engine.step()
    (_, out), = engine.pop_finished()
    assert out.token_ids == ref


def test_sleep_drops_the_states_and_wake_up_brings_them_back(tmp_path):
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_next")
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    ref = engine.generate(PROMPTS, params).token_ids
    engine.sleep()
    assert engine.states.conv is None
    engine.wake_up()
    assert engine.generate(PROMPTS, params).token_ids == ref


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "nemotron_h"])
def test_graph_decode_step_on_cpu_equals_the_eager_engine(tmp_path, family, triton_interpreter, monkeypatch):
    """The CUDA-graph decode step's own work run eagerly on the CPU (`test_cuda_graph`'s stand-in for a replay, after
    the capture's warm-up run): the linear layers (gated DeltaNet's; Nemotron-H's Mamba2) take their rows' state
    slots from the graph's static input buffer,
    padding rows (6 and then fewer sequences in buckets of 4 and 8, preemptions) read and write the scratch slot, and
    the seeded samples and log-probs (overlapped scheduling: input ids still on the device) equal the plain engine's;
    after a sleep and wake-up (new states: graphs captured again) too."""
    import torch

    import lathe.engine.llm_engine as llm
    from lathe.engine.cuda_graph import DecodeGraphs
    from lathe.engine.linear_state import LinearStateCache
    from lathe.engine.sampler import fused_settings
    from models.lathe_tiny import save_hf
    from .test_cuda_graph import _Replay

    if family == "nemotron_h":
        pytest.importorskip("transformers.models.nemotron_h")
        from models.nemotron_tiny import nemotron_model
        nemotron_model(seed=6).save_pretrained(path := tmp_path / "nemotron_h")
    else:
        path, _ = save_hf(tmp_path, family)
    monkeypatch.setattr("lathe.device.multiprocessor_count", lambda device: 4)
    monkeypatch.setattr("lathe.engine.triton_step.available", lambda device: True)
    monkeypatch.setattr(llm, "fused_settings", lambda device, vocab, seqs: fused_settings(
        torch.device("cuda"), vocab, seqs))                    # the CPU stands in for CUDA here

    def capture(self, key):         # the capture's warm-up run (which must not advance the rows' states), then a
        self._warm_up(key)          # stand-in that runs the step at each replay
        self.graphs[key] = _Replay(self, key)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    indices = []
    decode_step = LinearStateCache.decode_step
    monkeypatch.setattr(LinearStateCache, "decode_step", lambda self, index: indices.append(index) or
                        decode_step(self, index))
    params = SamplingParams(n=2, temperature=0.8, max_tokens=MAX, seed=2)
    outs = []
    for graphs in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=14,
                                             reserve_new_tokens=False, max_num_seqs=6, async_scheduling=graphs)
        if graphs:
            engine.runner.graphs = DecodeGraphs(engine.runner, 8)
        outs.append(engine.generate(PROMPTS[:3], params))
        if graphs:
            inputs = engine.runner.graphs.inputs
            assert indices and all(i.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()
                                   for i in indices), "a graph step's slots are not its static input row"
            engine.sleep()
            engine.wake_up()
            assert not engine.runner.graphs.graphs      # the states were freed: nothing captured against them stays
            outs.append(engine.generate(PROMPTS[:3], params))
    assert outs[0].metrics["rollout/num_preemptions"] > 0
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids
        assert_close_rel(sum(out.logprobs, []), sum(outs[0].logprobs, []), name="log-probs")


def test_fp8_rollout_is_refused_by_name(tmp_path):
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    with pytest.raises(ValueError, match=r"rollout.quantization.*Qwen3_5ForCausalLM"):
        LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=8, quantization="fp8")


def _prefilled(engine, monkeypatch) -> list[int]:
    """Counts the prompt tokens the engine's prefill steps compute (one entry per step)."""
    counts, prefill = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs, num_new: counts.append(sum(num_new)) or
                        prefill(seqs, num_new))
    return counts


@pytest.mark.parametrize("chunk,max_num_seqs", [(16384, 256), (3, 256), (16384, 3)])
def test_forked_samples_equal_samples_prefilled_apart(tmp_path, monkeypatch, chunk, max_num_seqs):
    """The `n` samples of a prompt fork from the first once its prompt is computed (their prompt's KV blocks
    shared, its linear-attention states copied, the first token drawn from its logits with each one's own seed):
    the same seeded tokens and log-probs as every sample prefilling its own prompt, each prompt computed once; with
    chunked prefill (a leader's followers wait across its chunks), and where a prompt's n samples exceed
    max_num_seqs (those past it prefill themselves). The states' slots and the blocks all come back."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    params = SamplingParams(n=4, temperature=1.0, max_tokens=MAX, seed=5)
    outs, counts = {}, {}
    for fork in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64,
                                             max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs)
        engine.fork_samples = fork
        counts[fork] = _prefilled(engine, monkeypatch)
        outs[fork] = engine.generate(PROMPTS, params)
        assert engine.states.slot == {} and len(engine.states.free) == engine.scheduler.max_num_seqs
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[True].token_ids == outs[False].token_ids
    assert_close_rel(sum(outs[True].logprobs, []), sum(outs[False].logprobs, []), name="log-probs")
    prompts = sum(len(p) for p in PROMPTS)
    assert sum(counts[False]) == 4 * prompts
    assert sum(counts[True]) == (prompts if max_num_seqs > 4 else 2 * prompts)    # groups of 3 and 1 when 3 fit


def test_forked_samples_survive_preemption_and_an_interrupt_mid_prefill(tmp_path):
    """A cache too small for all sequences (forked ones preempted and recomputed from their own tokens) and a weight
    sync's interrupt while a leader is half prefilled (it waits again with its followers): the tokens of a run
    without forks."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=7)
    ref = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    ref.fork_samples = False
    expected = ref.generate(PROMPTS, params).token_ids
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=12,
                                         reserve_new_tokens=False, max_num_batched_tokens=5)
    out = engine.generate(PROMPTS, params)
    assert out.metrics["rollout/num_preemptions"] > 0 and out.token_ids == expected
    engine.add_request("r", PROMPTS, params)
    engine.step()
    leader = engine.scheduler.prefilling
    assert leader is not None and len(leader.followers) == 2         # a leader mid-prefill, followers waiting
    engine.interrupt()
    assert engine.scheduler.prefilling is None and leader.followers and engine.states.slot == {}
    engine.load_weights(engine.model.state_dict().items(), version=1)
    while engine.has_unfinished_requests():
        engine.step()
    (_, again), = engine.pop_finished()
    assert again.token_ids == expected


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 256])
def test_cuda_shared_prefix_graphs_with_forked_samples(tmp_path, monkeypatch, head_dim):
    """Forked samples share their prompt's blocks: with the shared-prefix launch in the decode graphs (lifted for
    hybrids here, `llm_engine.HYBRID_SHARED_PREFIX`) each sample's log-probs are a teacher-forced forward's (fp32;
    fla's TF32 products) and its tokens those of the engine without the launch, at Qwen3.5's 256-wide attention heads
    too. Passing here is what lets the engine turn it on for hybrids."""
    pytest.importorskip("fla")
    import torch

    from lathe.engine import llm_engine
    from models.lathe_tiny import save_hf
    from .test_engine_gpu import shared_prefix_runs
    from .test_llm_engine import _teacher_forced
    monkeypatch.setattr(llm_engine, "HYBRID_SHARED_PREFIX", True)
    path, _ = save_hf(tmp_path, "qwen3_5_text", config={"head_dim": head_dim, "max_position_embeddings": 128})
    cpu_model, prompts, outs = shared_prefix_runs(path, monkeypatch)
    for prompt, ids, lps in zip(prompts, outs[0].token_ids, outs[0].logprobs):
        assert_close_rel(torch.tensor(lps, dtype=torch.float64), _teacher_forced(cpu_model, prompt, ids, 0.8),
                         rel=1e-2, name="log-probs")
    assert outs[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize("head_dim", [16, 256])
def test_graph_steps_with_shared_prefixes_of_forked_samples_on_cpu(tmp_path, head_dim, triton_interpreter,
                                                                   monkeypatch):
    """Forked samples share their prompt's blocks, so the decode graphs' shared-prefix launch (lifted for hybrids
    here, `llm_engine.HYBRID_SHARED_PREFIX`) finds their groups: the graph step's work run by Triton's interpreter
    (`test_graph_decode_step_on_cpu_equals_the_eager_engine`'s stand-in) attends over each prompt once per group and
    gives the eager engine's tokens and log-probs, at Qwen3.5's 256-wide attention heads too."""
    import torch

    import lathe.engine.llm_engine as llm
    from lathe.engine import cuda_graph
    from lathe.engine.cuda_graph import DecodeGraphs
    from lathe.engine.sampler import fused_settings
    from models.lathe_tiny import save_hf
    from .test_cuda_graph import _Replay

    path, _ = save_hf(tmp_path, "qwen3_5_text", config={"head_dim": head_dim})
    monkeypatch.setattr("lathe.device.multiprocessor_count", lambda device: 4)
    monkeypatch.setattr("lathe.engine.triton_step.available", lambda device: True)
    monkeypatch.setattr(llm, "fused_settings", lambda device, vocab, seqs: fused_settings(
        torch.device("cuda"), vocab, seqs))
    monkeypatch.setattr(llm, "HYBRID_SHARED_PREFIX", True)
    monkeypatch.setattr(cuda_graph, "PREFIX_MIN_TOKENS", 8)
    monkeypatch.setattr(cuda_graph, "PREFIX_MIN_TOKENS_WIDE", 8)

    def capture(self, key):         # as in the graph-step test above: the warm-up run, then a stand-in replay
        self._warm_up(key)
        self.graphs[key] = _Replay(self, key)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    prompts = [list(range(1, 23)), list(range(30, 49))]          # 22 and 19 tokens: 5 and 4 full blocks of 4
    params = SamplingParams(n=5, temperature=0.9, max_tokens=8, seed=4)
    outs, keys = [], []
    for graphs in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=60,
                                             reserve_new_tokens=False, async_scheduling=graphs,
                                             decode_backend="triton")
        if graphs:
            engine.runner.graphs = DecodeGraphs(engine.runner, 16)
            assert engine.runner.graphs.prefix_rows > 0
        outs.append(engine.generate(prompts, params))
        keys.append(set(engine.runner.graphs.graphs) if graphs else set())
    assert max(k[3] for k in keys[1]) > 0, "no step attended over a shared prefix"
    assert outs[1].token_ids == outs[0].token_ids
    assert_close_rel(sum(outs[1].logprobs, []), sum(outs[0].logprobs, []), name="log-probs")


def _turns(engine, first: list[list[int]], params, more: list[int], params2, between=None):
    """Two streamed turns of conversations: each first prompt, then it with its response and `more` after it (the
    agent loop's next turn). Returns (first outputs, second outputs, prefill tokens of the second turn)."""
    outs = {}

    def run():
        while engine.has_unfinished_requests():
            engine.step()
            outs.update(engine.pop_finished())
    engine.add_request("first", first, params)
    run()
    if between is not None:
        between(engine)
    before = engine.scheduler.num_prefill_tokens
    engine.add_request("next", [p + o + more for p, o in zip(first, outs["first"].token_ids)], params2)
    run()
    return outs["first"], outs["next"], engine.scheduler.num_prefill_tokens - before


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["step_by_step", "overlapped"])
@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop"])
def test_a_next_turn_continues_its_parked_conversation(tmp_path, async_scheduling, stop):
    """A finished streamed sequence keeps its blocks and state slot (parked); a prompt that continues it (its tokens,
    then more) takes them over and computes only the rest: the tokens and log-probs of an engine that computes the
    whole conversation again. A sequence that stops with overlapped scheduling has taken its last token in (the
    step that was running fed it), one that ends at its length or stops step by step has not: each computes from
    where its states are."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    first = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [20, 21, 22, 23, 24]]
    plain = SamplingParams(temperature=0.8, max_tokens=6, seed=1)
    params2 = SamplingParams(temperature=0.8, max_tokens=5, seed=2)
    stops = []
    if stop:        # a token each conversation samples early on, as its stop token
        free = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
        free.park_finished = False
        stops = [ids[2] for ids in _turns(free, first, plain, [11], params2)[0].token_ids]
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=1, stop_token_ids=stops)
    outs = {}
    for park in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64,
                                             async_scheduling=async_scheduling)
        engine.park_finished = park
        outs[park] = _turns(engine, first, params, [11, 12, 13], params2)
        assert len(engine.block_manager.parked) == (len(first) if park else 0)
    (a1, a2, computed), (b1, b2, parked) = outs[False], outs[True]
    assert a1.token_ids == b1.token_ids and a2.token_ids == b2.token_ids
    assert ("stop" in a1.finish_reasons) == stop
    assert_close_rel(sum(b2.logprobs, []), sum(a2.logprobs, []), name="next turn's log-probs")
    total = sum(len(p) + len(o) + 3 for p, o in zip(first, a1.token_ids))
    fed = sum(len(p) + len(o) - (not (stop and async_scheduling)) for p, o in zip(first, a1.token_ids))
    assert computed == total and parked == total - fed and b2.metrics["rollout/prefix_hit_tokens"] == fed


def test_parked_sequences_give_way_and_go_with_the_weights(tmp_path, monkeypatch):
    """Parked sequences give their blocks and slots up, least recently parked first, to sequences that need them (a
    cache and slots too few for them all: no preemption is charged to them, the tokens are a plain engine's); a
    weight load, an update or a sleep drops every one (their KV and states are the old weights'); `generate`'s
    sequences are never parked."""
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    first = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [20, 21, 22, 23, 24], [30, 31]]
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=1)
    from lathe.engine.linear_state import StateBlockManager
    outs, evicted = {}, []
    evict = StateBlockManager._evict
    monkeypatch.setattr(StateBlockManager, "_evict", lambda self, seq: evicted.append(seq) or evict(self, seq))
    for park in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=16,
                                             max_num_seqs=3, reserve_new_tokens=False)
        engine.park_finished = park
        outs[park] = _turns(engine, first, params, [11, 12, 13], params)
    assert len(evicted) >= 2 and 0 < outs[True][1].metrics["rollout/prefix_hit_tokens"]    # some kept, some not
    assert outs[True][0].token_ids == outs[False][0].token_ids and outs[True][1].token_ids == outs[False][1].token_ids
    assert outs[True][1].metrics["rollout/num_preemptions"] == outs[False][1].metrics["rollout/num_preemptions"]
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64)
    for drop in (lambda e: e.load_weights(e.model.state_dict().items(), version=1),
                 lambda e: e.update_weights(e.model.state_dict().items()),
                 lambda e: (e.sleep(), e.wake_up())):
        _, again, computed = _turns(engine, first[:2], params, [11], params, between=drop)
        assert not again.metrics["rollout/prefix_hit_tokens"] and computed == sum(
            len(p) + len(o) + 1 for p, o in zip(first, again.token_ids))
        engine.block_manager.reset()
    engine.generate(first, params)
    assert not engine.block_manager.parked and len(engine.states.free) == engine.scheduler.max_num_seqs


def test_the_parked_keys_memo_follows_the_tokens():
    """`prefix_hashes` (the parked conversations' keys, looked up at every admission check) gives each prefix's
    polynomial hash, is kept while the tokens stand, and is computed again when they change, at the same length too (a
    pending token resolved in place)."""
    from lathe.engine.linear_state import PARK_MODULUS, prefix_hashes
    from lathe.engine.sequence import Sequence

    def by_hand(ids):
        h = 0
        for token in ids:
            h = (h * 1_000_003 + token + 1) % PARK_MODULUS
        return h
    seq = Sequence([5, 9, 2, 7])
    first = prefix_hashes(seq)
    assert first == [by_hand(seq.token_ids[:i + 1]) for i in range(4)]
    assert prefix_hashes(seq) is first
    seq.token_ids[-1] = 8
    assert prefix_hashes(seq)[-1] == by_hand([5, 9, 2, 8]) != first[-1]
    seq.token_ids.append(3)
    assert prefix_hashes(seq)[-1] == by_hand([5, 9, 2, 8, 3])


@pytest.mark.gpu
def test_a_parked_conversation_continues_on_flash_in_bf16(tmp_path, monkeypatch):
    """On CUDA in bf16 (the engine's packed backend is flash varlen), a next turn that continues its parked
    conversation attends over the cached context through `CachedPrefill`'s packed form (flash called, the padded
    SDPA not), and its log-probs are near a float32 teacher-forced forward of the same weights."""
    pytest.importorskip("fla")
    from lathe.engine import paged_attention
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    calls = {"flash": 0, "padded": 0}
    flash, padded = paged_attention.causal_varlen, paged_attention.CachedPrefill._padded
    monkeypatch.setattr(paged_attention, "causal_varlen",
                        lambda *a, **k: calls.__setitem__("flash", calls["flash"] + 1) or flash(*a, **k))
    monkeypatch.setattr(paged_attention.CachedPrefill, "_padded",
                        lambda *a, **k: calls.__setitem__("padded", calls["padded"] + 1) or padded(*a, **k))
    engine = LatheEngine.from_pretrained(path, dtype=torch.bfloat16, device="cuda", eos_token_id=None,
                                         block_size=16, num_kv_blocks=64)
    assert engine.runner.cached_backend == "varlen"
    first = [list(range(1, 40)), list(range(50, 71))]
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=1)
    out1, out2, computed = _turns(engine, first, params, [11, 12, 13, 14, 15], params)
    assert out2.metrics["rollout/prefix_hit_tokens"] > 0 and calls["flash"] > 0 and calls["padded"] == 0
    model = load_lathe_model(path, torch.bfloat16).float()
    for p, o, ids, lps in zip(first, out1.token_ids, out2.token_ids, out2.logprobs):
        ref = _teacher_forced(model, p + o + [11, 12, 13, 14, 15], ids, 0.8)
        assert_close_rel(torch.tensor(lps, dtype=torch.float64), ref, rel=5e-2, name="next turn's log-probs (bf16)")


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_step_of_fresh_sequences_hands_the_layers_no_states(tmp_path, monkeypatch, family):
    """A prefill step whose sequences all start there (none holds a state slot yet) hands its linear layers no
    states (`LinearStep.read`: (None, None)), so they run the forms without given states (on CUDA fla's convolution
    and its kernels' zero-state variant); a step with a sequence that holds its slot (a prompt's later chunk, a
    preempted one's) reads them. Each mixer gives the output and final states of zero given states either way, and
    the engine transformers' greedy tokens with both kinds of steps in the run."""
    from lathe.engine.linear_state import LinearStep
    from models.lathe_tiny import save_hf
    from models.nemotron_tiny import nemotron_model
    if family == "nemotron_h":
        path, hf = tmp_path / family, nemotron_model(seed=6)
        hf.save_pretrained(path)
    else:
        path, hf = save_hf(tmp_path, family)
    seen, read = [], LinearStep.read
    monkeypatch.setattr(LinearStep, "read", lambda self: seen.append(self.fresh) or read(self))
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64,
                                         max_num_batched_tokens=5)         # prompts of up to 14 tokens: chunks
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3))
    assert out.token_ids == [_hf_greedy(hf, p, 3) for p in PROMPTS]
    assert True in seen and False in seen, seen
    # one mixer, both ways, on a packed stream of three sequences
    mixer = next(m for m in load_lathe_model(path).modules() if hasattr(m, "step") and hasattr(m, "out_proj"))
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    x = torch.randn(12, mixer.out_proj.out_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, (conv, final) = mixer(x, cu, 5, (None, None))
        given, (given_conv, given_final) = mixer(x, cu, 5, (torch.zeros_like(conv), torch.zeros_like(final)))
    assert final.abs().sum() > 0, "precondition: the final states are not zeros"
    pairs = ((out, given, "output"), (conv, given_conv, "convolution inputs"), (final, given_final, "states"))
    for a, b, name in pairs:
        assert_close_rel(a, b, rel=1e-6, name=name)
