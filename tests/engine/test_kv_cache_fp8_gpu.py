"""The FP8 KV cache on the GPU: each Triton kernel it touches (store, RoPE-store, paged decode with and without the
step's own token, split merge under a CUDA graph) against the PyTorch quantiser and a float64 reference over the
dequantised cache; the engine (bf16, CUDA graphs, Triton decode) with the FP8 cache against the bf16 cache and a
teacher-forced forward. Run with `-s` to see the gaps (printed as `fp8-kv ...` lines)."""

import pytest
import torch

from lathe.engine.kv_cache import FP8, KVCache, dequantize, quantize
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.paged_attention import decode_attention
from lathe.generation import SamplingParams
from lathe.models import load_lathe_model

from helpers import assert_close_rel, rel_error

from .conftest import PROMPTS

pytestmark = pytest.mark.gpu
MAX = 12


def _kv(g, t, hkv, dim):
    """bf16 (t, hkv, dim) rows with one head far past e4m3's 448 (a k_proj bias) and one tiny head."""
    x = torch.randn(t, hkv, dim, device="cuda", generator=g)
    x[:, 0] = x[:, 0] * 20 + 600
    x[:, -1] *= 1e-3
    return x.bfloat16()


def _paged(g, blocks, page, hkv, dim):
    (kc, ks), (vc, vs) = (quantize(_kv(g, blocks * page, hkv, dim).view(blocks, page, hkv, dim)) for _ in "kv")
    return kc, vc, (ks, vs)


def test_store_kernels_on_cuda_equal_the_torch_quantiser():
    """store_kv writes the e4m3 bytes and scales `quantize` gives (strided views of one q/k/v projection, head_dim
    128); rope_store_kv's rotated k within bf16's rounding of the reference's rotation (the kernel rotates in float32),
    its v exactly."""
    from lathe.engine.triton_store import rope_store_kv, store_kv
    from lathe.models.rope import apply_rotary
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks, page, hq, hkv, dim, t = 40, 16, 12, 4, 128, 37
    qkv = torch.cat([_kv(g, t, hq, dim), _kv(g, t, hkv, dim), _kv(g, t, hkv, dim)], dim=1)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    slots = torch.randperm(blocks * page, device="cuda", generator=g)[:t]
    ref = KVCache(1, blocks - 1, page, hkv, dim, dtype=FP8, device="cuda")
    ref.store(0, k, v, slots)                                     # index_copy_ (host-checked): the torch quantiser
    out = KVCache(1, blocks - 1, page, hkv, dim, dtype=FP8, device="cuda")
    store_kv(k, v, out.k[0], out.v[0], slots, out.layer_scales(0))
    for name in ("k", "v"):         # the same arithmetic: the same bytes but for a rare rounding tie
        assert_close_rel(getattr(out, f"{name}_scale")[0], getattr(ref, f"{name}_scale")[0], rel=1e-6, name=name)
        same = (getattr(out, name)[0].view(torch.uint8) == getattr(ref, name)[0].view(torch.uint8)).float().mean()
        print(f"fp8-kv store_kv {name}: {float(same):.6f} of the bytes equal the torch quantiser's")
        assert same > 0.999
    angles = torch.randn(t, dim // 2, device="cuda", generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    ref = KVCache(1, blocks - 1, page, hkv, dim, dtype=FP8, device="cuda")
    ref.store(0, apply_rotary(k, cos, sin), v, slots)
    out = KVCache(1, blocks - 1, page, hkv, dim, dtype=FP8, device="cuda")
    q_rot = rope_store_kv(q, k, v, cos, sin, out.k[0], out.v[0], slots, out.layer_scales(0))
    assert_close_rel(q_rot, apply_rotary(q, cos, sin), rel=1e-2, name="q")
    assert (out.v[0].view(torch.uint8) == ref.v[0].view(torch.uint8)).float().mean() > 0.999
    err = rel_error(dequantize(out.k[0], out.k_scale[0], torch.float64), dequantize(ref.k[0], ref.k_scale[0],
                                                                                    torch.float64))
    print(f"fp8-kv rope_store k vs rotate-then-quantise: {err:.3g}")
    assert err < 2e-2


@pytest.mark.parametrize("batch,hq,hkv,dim,splits", [(64, 14, 2, 64, 1), (3, 28, 4, 128, 8), (5, 12, 2, 128, 3)])
def test_decode_kernel_on_cuda_reads_the_fp8_cache(batch, hq, hkv, dim, splits):
    """paged_decode over an FP8 cache = float64 attention over the dequantised cache (bf16 q and output)."""
    from lathe.engine.triton_decode import paged_decode
    g = torch.Generator(device="cuda").manual_seed(batch + splits)
    kc, vc, scales = _paged(g, 300, 16, hkv, dim)
    lens = torch.randint(1, 700, (batch,), device="cuda", generator=g).int()
    tables = torch.randint(0, 300, (batch, 44), device="cuda", generator=g).int()
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    out = paged_decode(q, kc, vc, tables, lens, num_splits=splits, scales=scales)
    k64, v64 = dequantize(kc, scales[0], torch.float64), dequantize(vc, scales[1], torch.float64)
    err = assert_close_rel(out, decode_attention(q.double(), k64, v64, tables.long(), lens.long()), rel=1e-2,
                           name="paged decode (fp8)")
    print(f"fp8-kv paged_decode {batch}x{hq}/{hkv}x{dim} splits={splits}: {err:.3g}")


@pytest.mark.parametrize("v_size", [1.0, 1e-3, 1e-4])
def test_decode_kernel_on_cuda_in_float16_keeps_small_values(v_size):
    """float16 q over an FP8 cache of small V rows: the kernel scales V's tile (p x s_v would lie in float16's
    subnormals), so its error stays the PyTorch path's (float16 rounding) whatever V's size."""
    from lathe.engine.triton_decode import paged_decode
    g = torch.Generator(device="cuda").manual_seed(7)
    kc, _, (ks, _) = _paged(g, 300, 16, 4, 128)
    vc, vs = quantize(torch.randn(kc.shape, device="cuda", generator=g) * v_size)
    lens = torch.randint(1, 700, (5,), device="cuda", generator=g).int()
    tables = torch.randint(0, 300, (5, 44), device="cuda", generator=g).int()
    q = torch.randn(5, 28, 128, device="cuda", dtype=torch.float16, generator=g)
    want = decode_attention(q.double(), dequantize(kc, ks, torch.float64), dequantize(vc, vs, torch.float64),
                            tables.long(), lens.long())
    torch_err = rel_error(decode_attention(q, kc, vc, tables.long(), lens.long(), scales=(ks, vs)), want)
    err = assert_close_rel(paged_decode(q, kc, vc, tables, lens, num_splits=3, scales=(ks, vs)), want,
                           rel=max(2e-3, 3 * torch_err), name="paged decode (fp8, float16)")
    print(f"fp8-kv paged_decode float16 max|v|~{v_size:g}: {err:.3g} (torch path {torch_err:.3g})")


def test_decode_kernel_with_the_new_token_on_cuda_equals_rope_store_then_decode():
    """`new_kv` into an FP8 cache: the bytes and scales rope_store_kv writes, and the output of the plain kernel after
    rope_store_kv (the same arithmetic up to the rotation's fused products), over three splits."""
    from lathe.engine.triton_decode import paged_decode
    from lathe.engine.triton_store import rope_store_kv
    g = torch.Generator(device="cuda").manual_seed(7)
    batch, hq, hkv, dim, page, width, splits = 24, 12, 2, 128, 16, 32, 3
    blocks = batch * width
    kc, vc, (ks, vs) = _paged(g, blocks, page, hkv, dim)
    tables = torch.randperm(blocks, device="cuda", generator=g).view(batch, width).int()
    lens = torch.randint(1, width * page, (batch,), device="cuda", generator=g).int()
    pos = lens.long() - 1
    slots = tables.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    qkv = torch.cat([_kv(g, batch, hq, dim), _kv(g, batch, hkv, dim), _kv(g, batch, hkv, dim)], dim=1)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    angles = torch.randn(batch, dim // 2, device="cuda", generator=g)
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    q_rot = rope_store_kv(q, k, v, cos, sin, ref[0], ref[1], slots, (ref[2], ref[3]))
    want = paged_decode(q_rot, ref[0], ref[1], tables, lens, num_splits=splits, scales=(ref[2], ref[3]))
    out = paged_decode(q, kc, vc, tables, lens, num_splits=splits, new_kv=(k, v, cos, sin, slots), scales=(ks, vs))
    # the same arithmetic but for the compiler's choice of which product of the rotation to fuse: a k value may land
    # on the neighbouring e4m3 step now and then; v is stored as loaded
    assert_close_rel(ks, ref[2], rel=1e-6, name="k scales")
    assert_close_rel(dequantize(kc, ks, torch.float64), dequantize(ref[0], ref[2], torch.float64), rel=1e-2,
                     name="k cache")
    assert torch.equal(vc.view(torch.uint8), ref[1].view(torch.uint8)) and torch.equal(vs, ref[3])
    assert_close_rel(out, want, rel=5e-3, name="new-token launch")
    k64, v64 = dequantize(kc, ks, torch.float64), dequantize(vc, vs, torch.float64)
    assert_close_rel(out, decode_attention(q_rot.double(), k64, v64, tables.long(), lens.long()), rel=1e-2,
                     name="reference")


def test_fp8_split_decode_replays_in_a_cuda_graph():
    """Split launches over an FP8 cache captured in one graph with shared counters, replayed with new queries."""
    from lathe.engine.triton_decode import paged_decode
    g = torch.Generator(device="cuda").manual_seed(1)
    batch, hq, hkv, dim, splits = 24, 12, 2, 128, 6
    caches = [_paged(g, 400, 16, hkv, dim) for _ in range(3)]
    tables = torch.randint(0, 400, (batch, 64), device="cuda", generator=g).int()
    lens = torch.randint(1, 1000, (batch,), device="cuda", generator=g).int()
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")

    def step():
        return [paged_decode(q, kc, vc, tables, lens, num_splits=splits, counters=counters, scales=s)
                for kc, vc, s in caches]
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        q.copy_(torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert counters.eq(0).all()
        for out, (kc, vc, (ks, vs)) in zip(outs, caches):
            ref = decode_attention(q.double(), dequantize(kc, ks, torch.float64), dequantize(vc, vs, torch.float64),
                                   tables.long(), lens.long())
            assert_close_rel(out, ref, rel=1e-2, name="graph-replayed fp8 split decode")


@torch.no_grad()
def _teacher_forced(model, prompt, response):
    ids = torch.tensor([prompt + response], device="cuda")
    logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device="cuda")[:, None]).squeeze(-1)


def _gaps(model, out, prompts):
    """Norm-relative gap of all the engine's log-probs to the teacher-forced forward's (one vector)."""
    ref = torch.cat([_teacher_forced(model, p, ids) for p, ids in zip(prompts, out.token_ids)]).cpu()
    got = torch.tensor(sum(out.logprobs, []), dtype=torch.float64)
    return float((got - ref).norm() / ref.norm())


def _model(path, family):
    """The bf16 model on the GPU; Qwen2's: one dimension of every K head's bias raised by 100 (a real Qwen2's k_proj
    bias is that large in a few dimensions)."""
    model = load_lathe_model(path, torch.bfloat16, device="cuda")
    if family == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.view(-1, model.config.head_dim)[:, 0] += 100
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_engine_with_the_fp8_cache_on_cuda_tracks_bf16(checkpoints, family, backend):
    """bf16 model, CUDA graphs, decode by `backend`: the FP8 cache's log-probs' gap to the teacher-forced bf16 forward
    (no cache) within the CPU test's bounds (0.02; Qwen2 with its raised bias 0.06; the CPU engine measured 0.0044 and
    0.037). The greedy tokens shared with the bf16 cache's are printed, not asserted: a random tiny model's greedy
    sequence leaves the other at its first near-tie and never rejoins it (42 to 96 of 96 on an H200, 2026-11-30),
    while the log-probs are scored against the tokens each engine drew."""
    path, _ = checkpoints[family]
    prompts = [p for p in PROMPTS for _ in range(2)]
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX)
    reference = _model(path, family)
    outs, gaps = {}, {}
    for dtype in ("auto", "fp8"):
        engine = LatheEngine(_model(path, family), eos_token_id=None, block_size=16, num_kv_blocks=64,
                             decode_backend=backend, kv_cache_dtype=dtype)
        assert engine.runner.graphs is not None and engine.runner.decode_backend == backend
        outs[dtype] = engine.generate(PROMPTS, params)
        gaps[dtype] = _gaps(reference, outs[dtype], prompts)
        del engine
    same = sum(a == b for x, y in zip(outs["fp8"].token_ids, outs["auto"].token_ids) for a, b in zip(x, y))
    total = len(prompts) * MAX
    print(f"fp8-kv engine {family} {backend}: log-prob gap to teacher-forced bf16 {gaps['fp8']:.3g} (bf16 cache "
          f"{gaps['auto']:.3g}); greedy tokens equal to the bf16 cache's {same}/{total}")
    assert gaps["fp8"] < (0.06 if family == "qwen2" else 0.02) + gaps["auto"]
