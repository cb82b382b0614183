"""Attention over the paged KV cache in pure PyTorch: the reference path (CPU tests, any device).

Both functions read every key from the cache (the new tokens' K/V are stored first), so a sequence
whose prefix blocks another sequence of the same batch is writing sees them. GQA is handled by SDPA's
`enable_gqa`. Faster kernels (FlexAttention, Triton paged decode) must agree with these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, max_blocks) block ids -> (B, max_blocks * block_size, kv_heads, head_dim) contiguous context."""
    b, nb = block_tables.shape
    g = cache[block_tables]                                   # (B, nb, bs, Hkv, D)
    return g.reshape(b, nb * cache.shape[1], *cache.shape[2:])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: list[int], context_lens: list[int], block_tables: list[list[int]],
                      scale: float | None = None) -> torch.Tensor:
    """Causal attention of ragged new tokens over their whole context.

    q: (T, Hq, D), sequences laid end to end by `cu_seqlens_q`; sequence i's new tokens are the last
    `n_i` of its `context_lens[i]` tokens, whose K/V are in the blocks `block_tables[i]`.
    """
    outs = []
    for i, ctx in enumerate(context_lens):
        start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        n = end - start
        table = torch.tensor(block_tables[i], device=q.device)[None]
        k = gather_kv(k_cache, table)[0, :ctx].transpose(0, 1)[None]   # (1, Hkv, ctx, D)
        v = gather_kv(v_cache, table)[0, :ctx].transpose(0, 1)[None]
        qs = q[start:end].transpose(0, 1)[None]                        # (1, Hq, n, D)
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos       # (n, ctx)
        out = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                             enable_gqa=qs.shape[1] != k.shape[1])
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One new token per sequence: q (B, Hq, D); block_tables (B, max_blocks) padded with any valid id;
    context_lens (B,) tokens of each sequence, the new one included. Returns (B, Hq, D)."""
    k = gather_kv(k_cache, block_tables).transpose(1, 2)              # (B, Hkv, L, D)
    v = gather_kv(v_cache, block_tables).transpose(1, 2)
    L = k.shape[2]
    mask = (torch.arange(L, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]  # (B,1,1,L)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0, :]
