"""The KV store kernel, run in Triton's CPU interpreter, against `index_copy_`."""

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
