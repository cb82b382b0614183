"""lathe's engine over Nemotron-H (Mamba2 layers with per-sequence states, attention without RoPE, the MoE with
non-gated experts): greedy tokens equal transformers' generate with preemption and chunked prefill, and forked
samples equal samples prefilled apart (the CUDA-graph decode step's work, run on the CPU, against the eager engine's:
tests/engine/test_hybrid_engine.py)."""

import pytest
import torch

pytest.importorskip("transformers.models.nemotron_h")

from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402

from helpers import assert_close_rel  # noqa: E402

from .conftest import PROMPTS  # noqa: E402
from .test_llm_engine import MAX, _hf_greedy  # noqa: E402


def _saved(tmp_path, **overrides):
    from models.nemotron_tiny import nemotron_model
    hf = nemotron_model(seed=6, **overrides)
    hf.save_pretrained(tmp_path)
    return tmp_path, hf


def test_greedy_equals_transformers_generate_with_preemption_and_chunked_prefill(tmp_path):
    path, hf = _saved(tmp_path)
    expected = [tokens for p in PROMPTS for tokens in [_hf_greedy(hf, p, MAX)] * 2]
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"
    engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=10,
                                         reserve_new_tokens=False, max_num_batched_tokens=3)
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=MAX))
    assert out.token_ids == expected
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache.num_layers == 1      # one attention layer
    assert engine.states.shapes[1][0] == 2 and engine.states.shapes[1][2:] == (4, 8, 8)   # 2 Mamba2 layers (H, P, N)
    assert engine.states.slot == {} and len(engine.states.free) == engine.scheduler.max_num_seqs


def test_forked_samples_equal_samples_prefilled_apart(tmp_path):
    path, _ = _saved(tmp_path, moe_latent_size=12)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=MAX, seed=5)
    outs = {}
    for fork in (False, True):
        engine = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64,
                                             max_num_batched_tokens=5)
        engine.fork_samples = fork
        outs[fork] = engine.generate(PROMPTS, params)
        assert engine.states.slot == {} and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[True].token_ids == outs[False].token_ids
    assert_close_rel(sum(outs[True].logprobs, []), sum(outs[False].logprobs, []), name="log-probs")


def test_fp8_rollout_is_refused_by_name(tmp_path):
    """(Tensor-parallel replicas and data-parallel attention run it: tests/engine/test_tensor_parallel.py,
    test_data_parallel.py.)"""
    path, _ = _saved(tmp_path)
    with pytest.raises(ValueError, match=r"rollout.quantization.*NemotronHForCausalLM"):
        LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=8, quantization="fp8")


@pytest.mark.gpu
def test_cuda_engine_and_its_graphs_equal_the_cpu_engine(tmp_path):
    """On CUDA in float32 the engine's greedy tokens are the CPU engine's (which equal transformers' above); in bf16,
    where the experts run as grouped matmuls (Hopper) and the decode steps can be captured, decode steps replayed
    from CUDA graphs give the eager engine's, with preemptions (padding rows on the scratch slot), parting at a
    near-tie only."""
    from .test_hybrid_engine import _assert_same_greedy
    path, _ = _saved(tmp_path)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    expected = LatheEngine.from_pretrained(path, eos_token_id=None, block_size=4, num_kv_blocks=64).generate(
        PROMPTS[:3], params)
    fp32 = LatheEngine.from_pretrained(path, device="cuda", eos_token_id=None, block_size=4, num_kv_blocks=64)
    out = fp32.generate(PROMPTS[:3], params)
    assert out.token_ids == expected.token_ids
    for got, want in zip(out.logprobs, expected.logprobs):
        assert_close_rel(got, want, rel=1e-3, name="CUDA vs CPU engine log-probs")
    outs = {}
    for eager in (True, False):
        engine = LatheEngine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, eos_token_id=None,
                                             block_size=4, num_kv_blocks=14, reserve_new_tokens=False,
                                             enforce_eager=eager)
        assert (engine.runner.graphs is None) == eager
        outs[eager] = engine.generate(PROMPTS[:3], params)
    assert outs[True].metrics["rollout/num_preemptions"] > 0 and outs[False].metrics["rollout/graph_captures"] > 0
    _assert_same_greedy(outs[False], outs[True], exact=False)


def test_the_states_leave_the_kv_cache_half_of_the_engines_budget(tmp_path, monkeypatch):
    """The state slots take at most half of what gpu_memory_utilization leaves beside the allocated memory (an H100's
    first nemotron-nano-8l run gave them all of it: the KV cache got one block), and at most 30% of the free memory."""
    from lathe import device as accel
    from lathe.engine.linear_state import state_layout, state_slots
    from lathe.models.config import LatheConfig
    path, _ = _saved(tmp_path)
    cfg = LatheConfig.from_pretrained(path)
    layers, conv, kernel, recurrent = state_layout(cfg)
    per_slot = layers * (conv * (kernel - 1) * 4 + 4 * recurrent[0] * recurrent[1] * recurrent[2])
    gib = 1 << 30
    monkeypatch.setattr(accel, "memory_info", lambda device: (40 * gib, 80 * gib))
    monkeypatch.setattr(accel, "memory_allocated", lambda device: 38 * gib)
    cuda = torch.device("cuda")
    assert state_slots(cfg, 10 ** 9, torch.float32, cuda, 0.5) == int(gib // per_slot) - 1       # half of 2 GiB
    assert state_slots(cfg, 10 ** 9, torch.float32, cuda) == int(12 * gib // per_slot) - 1      # 30% of 40 GiB
    assert state_slots(cfg, 7, torch.float32, cuda, 0.5) == 7
