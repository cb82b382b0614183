"""Attention backends: packed per-sequence SDPA equals masked attention; backend choice; varlen on CUDA."""

import pytest
import torch

from lathe.models.attention import PackedAttention, PaddedAttention, select_packed_backend, varlen_signature
from lathe.models.packing import pack_padded, unpack_to_padded

from helpers import assert_close_rel


def _qkv(B=3, L=9, hq=4, hkv=2, d=8, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, L, h, d, generator=gen).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)]


def _mask(B=3, L=9):
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return mask


def _naive(q, k, v, mask):
    """Explicit softmax(QK^T/sqrt(d)) V with GQA, causal and padding masks."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    L = q.shape[1]
    allowed = torch.ones(L, L, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def test_padded_attention_equals_explicit_softmax():
    q, k, v = _qkv()
    mask = _mask()
    out = PaddedAttention(mask)(q, k, v)
    real = mask.bool()
    assert_close_rel(out[real], _naive(q, k, v, mask)[real], name="attention output")
    assert torch.isfinite(out).all()


def test_packed_sdpa_equals_padded_attention():
    q, k, v = _qkv()
    mask = _mask()
    p = pack_padded(torch.zeros_like(mask), mask)
    flat = [x.flatten(0, 1)[p.indices] for x in (q, k, v)]
    out = unpack_to_padded(PackedAttention(p.cu_seqlens, p.max_seqlen, "sdpa")(*flat), p)
    assert_close_rel(out[mask.bool()], _naive(q, k, v, mask)[mask.bool()], name="attention output")


def test_backend_selection_on_cpu():
    cpu = torch.device("cpu")
    assert select_packed_backend("auto", cpu, torch.bfloat16) == "sdpa"
    assert select_packed_backend("sdpa", cpu, torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        select_packed_backend("varlen", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown"):
        select_packed_backend("flash9", cpu, torch.float32)


def test_varlen_signature_is_probed():
    params = varlen_signature()
    if params is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert "window_size" in params or "is_causal" in params


@pytest.mark.gpu
def test_varlen_equals_sdpa_on_cuda():
    q, k, v = _qkv(dtype=torch.bfloat16, device="cuda")
    mask = _mask().cuda()
    p = pack_padded(torch.zeros_like(mask), mask)
    flat = [x.flatten(0, 1)[p.indices] for x in (q, k, v)]
    assert select_packed_backend("auto", torch.device("cuda"), torch.bfloat16) == "varlen"
    fast = PackedAttention(p.cu_seqlens, p.max_seqlen, "varlen")(*flat)
    ref = PackedAttention(p.cu_seqlens, p.max_seqlen, "sdpa")(*flat)
    assert (fast.float() - ref.float()).abs().max() < 2e-2


@pytest.mark.gpu
def test_varlen_grouped_kv_equals_repeated_heads_in_value_and_gradients():
    """K/V left at their own head count (the kernel's native grouped-query path, where `varlen_takes_gqa`) give
    what K/V repeated to the query heads give: output and the gradients of q, k and v."""
    from lathe.models.attention import _repeat_kv, varlen_takes_gqa
    torch.manual_seed(0)
    lens = [300, 17, 1, 129, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 64, device="cuda", dtype=torch.bfloat16) for h in (12, 2, 2))
    grad = torch.randn_like(q)
    attn = PackedAttention(cu, max(lens), "varlen")
    outs = []
    for repeat in (False, True):
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = attn(qq, *((_repeat_kv(kk, 6, 1), _repeat_kv(vv, 6, 1)) if repeat else (kk, vv)))
        outs.append([out, *torch.autograd.grad(out, (qq, kk, vv), grad)])
    for a, b in zip(*outs):
        assert a.shape == b.shape and (a.float() - b.float()).norm() <= 1e-2 * b.float().norm()
    print("varlen_takes_gqa:", varlen_takes_gqa(torch.cuda.current_device(), torch.bfloat16))


@pytest.mark.gpu
def test_bf16_model_on_cuda_varlen_matches_sdpa_in_value_and_gradient(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from lathe.models import load_lathe_model
    cfg = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load_lathe_model(tmp_path, torch.bfloat16, device="cuda")
    assert model.packed_backend() == "varlen"
    B, L = 6, 300
    ids = torch.randint(0, 1000, (B, L), device="cuda")
    lens = torch.randint(20, L, (B,))
    mask = (torch.arange(L) >= (L - lens)[:, None]).long().cuda()
    p = pack_padded(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    probe = torch.randn(int(mask.sum()), 256, device="cuda")   # a loss that is not constant after RMSNorm
    outs = {}
    for backend in ("varlen", "sdpa"):
        model.attn_backend = backend
        model.zero_grad()
        h = model.forward_packed(p.input_ids, p.position_ids, p.cu_seqlens, p.max_seqlen)
        (h.float() * probe).sum().backward()
        attn = model.model.layers[0].self_attn
        outs[backend] = (h.float(), [lin.weight.grad.float().clone() for lin in (attn.q_proj, attn.k_proj, attn.v_proj)])
    (h1, g1), (h0, g0) = outs["varlen"], outs["sdpa"]
    assert (h1 - h0).abs().max() <= 0.02 * h0.abs().max()
    for a, b in zip(g1, g0):        # q, and the grouped k and v (8 query heads over 2 K/V heads)
        assert (a - b).norm() <= 0.02 * b.norm()
    model.attn_backend = "auto"
    with torch.no_grad():
        unpadded = model(ids, mask).logits.float()         # auto: unpad + varlen on CUDA
        model.padded_attention = "mask"
        masked = model(ids, mask).logits.float()
    assert (unpadded - masked)[mask.bool()].abs().max() <= 0.02 * masked.abs().max()
