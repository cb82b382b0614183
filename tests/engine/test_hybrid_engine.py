"""lathe's engine over the hybrid linear-attention families: Qwen3.5's greedy tokens equal transformers' generate
with preemption and chunked prefill in the run, Qwen3-Next's sampled log-probs equal a teacher-forced forward, an
interrupted partial rollout continues with the same tokens, and the state slots come back
(`lathe.engine.linear_state`)."""

import pytest

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


def test_fp8_rollout_is_refused_by_name(tmp_path):
    from models.lathe_tiny import save_hf
    path, _ = save_hf(tmp_path, "qwen3_5_text")
    with pytest.raises(ValueError, match=r"rollout.quantization.*Qwen3_5ForCausalLM"):
        LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=8, quantization="fp8")
