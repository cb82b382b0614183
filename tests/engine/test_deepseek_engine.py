"""The DeepSeek-V3 family (latent attention with the decompressed per-head K/V in the paged cache, its MoE) in
lathe's engine on the CPU: greedy tokens equal transformers' `generate` with prefix sharing, chunked prefill and
preemption in the runs; the engine's log-probs equal the teacher-forced forward; what the engine leaves off for it is
refused by name."""

import pytest
import torch

from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel
from models.deepseek_tiny import deepseek_model

from .conftest import PROMPTS
from .test_llm_engine import _engine, _hf_greedy

MAX = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek") / "ckpt"
    hf = deepseek_model(seed=2)
    hf.save_pretrained(path)
    return path, hf


def test_greedy_equals_transformers_generate(checkpoint):
    path, hf = checkpoint
    expected = [t for t in map(lambda p: _hf_greedy(hf, p, MAX), PROMPTS) for _ in range(2)]
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    # one run with prefix sharing, prompts cut in chunks of 6 tokens, and a cache small enough to preempt
    engine = _engine(path, num_kv_blocks=10, reserve_new_tokens=False, max_num_batched_tokens=6)
    assert engine.kv_cache.shape[2:] == (1, 24)     # the latent (16) and k's rope part (8), shared by the 4 heads
    assert engine.kv_cache.latent and all(k is v for k, v in zip(engine.kv_cache.k, engine.kv_cache.v))
    assert engine.kv_cache.nbytes == engine.kv_cache.buffer.numel() * 4                 # (one buffer: K is V)
    assert engine.generate(PROMPTS, params).token_ids == expected
    assert engine.scheduler.num_preemptions > 0


def test_log_probs_equal_teacher_forced_forward(checkpoint):
    path, _ = checkpoint
    model = load_lathe_model(path)
    params = SamplingParams(n=2, temperature=0.7, top_k=20, max_tokens=MAX, seed=1)
    out = _engine(path).generate(PROMPTS, params)
    for prompt, ids, lps in zip([p for p in PROMPTS for _ in range(2)], out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double() / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert_close_rel(lps, ref, name="log-probs")


def test_what_the_engine_leaves_off_is_refused(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="fuse_projections=True: not implemented for DeepseekV3ForCausalLM"):
        _engine(path, fuse_projections=True)
    with pytest.raises(ValueError, match="quantization='fp8'.*latent attention"):
        _engine(path, quantization="fp8")


def test_engine_on_the_triton_kernel_equals_torch(triton_interpreter, checkpoint):
    """The Triton decode kernel (Triton's CPU interpreter) over the latent attention's heads of width 20 (padded in
    the kernel to its block) gives the PyTorch decode's tokens and log-probs."""
    path, _ = checkpoint
    params = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3)
    engines = {b: _engine(path, decode_backend=b) for b in ("torch", "triton")}
    assert engines["triton"].runner.decode_backend == "triton"
    outs = {b: engine.generate(PROMPTS[:1], params) for b, engine in engines.items()}
    assert outs["triton"].token_ids == outs["torch"].token_ids
    assert_close_rel(sum(outs["triton"].logprobs, []), sum(outs["torch"].logprobs, []), name="log-probs")
