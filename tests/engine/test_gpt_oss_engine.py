"""GPT-OSS (attention sinks, a sliding window of 4, its MoE) in lathe's engine on the CPU: greedy tokens equal
transformers' `generate` with prefix sharing, fused projections, chunked prefill and preemption in the runs, and the
engine's log-probs equal the teacher-forced forward; the Triton decode kernel (Triton's CPU interpreter) with sinks
and windows against the PyTorch reference, and in the engine."""

import pytest
import torch

from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel
from models.gpt_oss_tiny import gpt_oss_model

from .conftest import PROMPTS
from .test_llm_engine import _engine, _hf_greedy

MAX = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss") / "ckpt"
    hf = gpt_oss_model(seed=2)
    hf.save_pretrained(path)
    return path, hf


def test_greedy_equals_transformers_generate(checkpoint):
    path, hf = checkpoint
    expected = [t for t in map(lambda p: _hf_greedy(hf, p, MAX), PROMPTS) for _ in range(2)]
    assert len({tuple(t) for t in expected}) > 2, "precondition: prompts give different continuations"
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    fused = _engine(path, fuse_projections=True)            # prefix sharing on; q/k/v (with biases) one matmul
    assert fused.generate(PROMPTS, params).token_ids == expected
    chunked = _engine(path, max_num_batched_tokens=6, enable_prefix_caching=False)   # prompts cut in chunks
    assert chunked.generate(PROMPTS, params).token_ids == expected
    small = _engine(path, num_kv_blocks=10, reserve_new_tokens=False)
    assert small.generate(PROMPTS, params).token_ids == expected
    assert small.scheduler.num_preemptions > 0


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


@pytest.mark.parametrize("splits,window", [(3, 5), (3, None)])      # one split: the engine test below
def test_triton_kernel_with_sinks_and_window_equals_reference(triton_interpreter, splits, window):
    """The Triton decode kernel (Triton's CPU interpreter) with sinks, with and without a window, over splits (some
    left empty by the window), plain and with the step's own token rotated and stored in the launch (`new_kv`)."""
    from lathe.engine.paged_attention import decode_attention
    from lathe.engine.triton_decode import paged_decode
    from lathe.engine.triton_store import rope_store_kv
    g = torch.Generator().manual_seed(splits)
    batch, hq, hkv, dim, page = 3, 4, 2, 16, 4
    lens = torch.tensor([1, 9, 30])
    tables = torch.randperm(30, generator=g)[:24].view(batch, 8).int()
    kc, vc = (torch.randn(30, page, hkv, dim, generator=g) for _ in range(2))
    q, k, v = (torch.randn(batch, heads, dim, generator=g) for heads in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    ref = decode_attention(q, kc, vc, tables.long(), lens, sinks=sinks, window=window)
    out = paged_decode(q, kc, vc, tables, lens.int(), num_splits=splits, block_n=16, sinks=sinks, window=window)
    assert_close_rel(out, ref, name="paged decode with sinks")
    pos = lens - 1
    slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    angles = torch.randn(batch, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_k, ref_v = kc.clone(), vc.clone()
    q_rot = rope_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots)
    out = paged_decode(q, kc, vc, tables, lens.int(), num_splits=splits, block_n=16, new_kv=(k, v, cos, sin, slots),
                       sinks=sinks, window=window)
    assert_close_rel(out, decode_attention(q_rot, ref_k, ref_v, tables.long(), lens, sinks=sinks, window=window),
                     name="paged decode with the new token, sinks and a window")


def test_engine_on_the_triton_kernel_equals_torch(triton_interpreter, checkpoint):
    path, _ = checkpoint
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
    outs = {b: _engine(path, decode_backend=b).generate(PROMPTS[:2], params) for b in ("torch", "triton")}
    assert outs["triton"].token_ids == outs["torch"].token_ids
    assert_close_rel(sum(outs["triton"].logprobs, []), sum(outs["torch"].logprobs, []), name="log-probs")
