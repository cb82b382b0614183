"""The KV store kernel, run in Triton's CPU interpreter, against `index_copy_`."""

import pytest
import torch


def test_store_kv_writes_both_caches_at_their_slots(triton_interpreter):
    from lathe.engine.triton_store import store_kv
    g = torch.Generator().manual_seed(0)
    blocks, page, hkv, dim = 6, 4, 2, 24                 # kv_heads x head_dim = 48: not a power of two
    kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
    ref_k, ref_v = kc.clone(), vc.clone()
    qkv = torch.randn(5, 3, hkv, dim, generator=g)        # k and v as strided views, as the projections give them
    k, v = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 7, 13, 22, 23])
    store_kv(k, v, kc, vc, slots)
    ref_k.view(-1, hkv, dim).index_copy_(0, slots, k)
    ref_v.view(-1, hkv, dim).index_copy_(0, slots, v)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_rope_store_rotates_q_and_k_and_stores_k_and_v(triton_interpreter):
    """One launch: q and k rotated as `apply_rotary` rotates them, k and v stored at their slots, from the strided
    views a fused q/k/v projection gives (GQA, head_dim 24: halves of 12, not a power of two)."""
    from lathe.engine.triton_store import rope_store_kv
    from lathe.models.rope import apply_rotary
    from helpers import assert_close_rel
    g = torch.Generator().manual_seed(1)
    blocks, page, hq, hkv, dim, t = 6, 4, 6, 2, 24, 5
    kc, vc = (torch.randn(blocks, page, hkv, dim, generator=g) for _ in range(2))
    ref_k, ref_v = kc.clone(), vc.clone()
    qkv = torch.randn(t, (hq + 2 * hkv) * dim, generator=g)
    q, k, v = (x.view(t, -1, dim) for x in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    angles = torch.randn(t, dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([0, 7, 13, 22, 23])
    out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots)
    ref_k.view(-1, hkv, dim).index_copy_(0, slots, apply_rotary(k, cos, sin))
    ref_v.view(-1, hkv, dim).index_copy_(0, slots, v)
    assert out.is_contiguous()
    assert_close_rel(out, apply_rotary(q, cos, sin), rel=1e-6, name="q")
    assert_close_rel(kc, ref_k, rel=1e-6, name="k cache")
    assert torch.equal(vc, ref_v)


def _rotating_engine_equals_plain(checkpoints, monkeypatch, family, spy, **engine_kwargs):
    """Generate with the plain engine, then with decode layers that hand the attention q and k before RoPE (as on
    CUDA; `spy(calls)` patches the launch under test to record into `calls`); the same tokens and log-probs, greedy
    and seeded. Returns the recorded calls."""
    from lathe.engine import step_attention, triton_store
    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models import load_lathe_model
    from helpers import assert_close_rel
    from .conftest import PROMPTS

    path, _ = checkpoints[family]
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3)]
    outs, calls = [], []
    for fused in (False, True):
        if fused:
            init = step_attention.DecodeAttention.__post_init__
            monkeypatch.setattr(step_attention.DecodeAttention, "__post_init__",
                                lambda self: (setattr(self, "rotates", True), init(self))[1])
            monkeypatch.setattr(triton_store, "can_rope_store", lambda *a: True)     # the CPU stands in for CUDA
            spy(calls)
        engine = LatheEngine(load_lathe_model(path, torch.float32), eos_token_id=None, block_size=4,
                             num_kv_blocks=64, **engine_kwargs)
        outs.append([engine.generate(PROMPTS, p) for p in params])
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert_close_rel(torch.tensor(sum(b.logprobs, [])), torch.tensor(sum(a.logprobs, [])), name="log-probs")
    return calls


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_engine_with_rope_in_the_store_launch_equals_the_plain_engine(checkpoints, triton_interpreter, monkeypatch,
                                                                      family):
    """Decode steps whose layers hand the attention q and k before RoPE (as on CUDA) and rotate them in the store's
    launch (the kernel run by the interpreter; PyTorch decode attention): the plain engine's tokens and log-probs,
    greedy and seeded, with the q/k norms of Qwen3 applied before the rotation."""
    from lathe.engine import triton_store
    kernel = triton_store.rope_store_kv

    def spy(calls):
        monkeypatch.setattr(triton_store, "rope_store_kv", lambda *a: calls.append(1) or kernel(*a))
    assert _rotating_engine_equals_plain(checkpoints, monkeypatch, family, spy, decode_backend="torch")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_engine_with_rope_store_and_attention_in_one_launch_equals_the_plain_engine(checkpoints, triton_interpreter,
                                                                                   monkeypatch, family):
    """With the Triton decode kernel, the decode steps' RoPE, K/V store and attention run in one launch
    (`paged_decode(new_kv=...)`, by the interpreter): the plain engine's tokens and log-probs, greedy and seeded."""
    from lathe.engine import triton_decode
    kernel = triton_decode.paged_decode

    def spy(calls):
        monkeypatch.setattr(triton_decode, "paged_decode",
                            lambda *a, **k: calls.append("new_kv" in k) or kernel(*a, **k))
    assert any(_rotating_engine_equals_plain(checkpoints, monkeypatch, family, spy, decode_backend="triton"))
