"""Small launch scripts for Nsight Compute (ncu, in the GPU machines' /usr/local/cuda/bin): each warms a kernel up and
launches it once more, so that `ncu --launch-skip N --launch-count 1` profiles one warm launch.

    ncu -k regex:_decode_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        --section SchedulerStats --metrics regex:"smsp__average_warps_issue_stalled_.*_per_issue_active.ratio" \\
        python bench/ncu_targets.py attention 12 128          # 1.5B's heads and head size; 14 64 for 0.5B
    ncu -k regex:"_streamk|nvjet" --launch-skip 9 --launch-count 3 --section SpeedOfLight \\
        python bench/ncu_targets.py gemm                      # 1.5B gate/up: Gluon data-parallel, stream-K, cuBLAS

`attention`: the engine's decode kernel as a decode step launches it (batch 256, 512-token contexts in 16-token pages
scattered over the cache, the step's own token rotated and stored in the same launch, one split, launched as a
programmatic dependent), four launches. `gemm`: bench/decode_gemm_gluon.py's kernel (128x128 data-parallel, then
256x128 stream-K) and cuBLAS on 1.5B's fused gate/up at 256 rows, four rounds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def attention(hq: int, d: int, batch: int = 256, hkv: int = 2, page: int = 16, ctx: int = 512) -> None:
    from lathe.engine.triton_decode import paged_decode
    dev = torch.device("cuda")
    per = ctx // page
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(batch * per + 64, page, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * per, device=dev, generator=g).int().view(batch, per)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    kn = torch.randn(batch, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    vn = torch.randn_like(kn)
    cos = torch.randn(batch, d, device=dev, dtype=torch.bfloat16, generator=g)
    sin = torch.randn_like(cos)
    slots = tables[:, -1].long() * page + (ctx - 1) % page
    for _ in range(4):
        paged_decode(q, kc, vc, tables, lens, num_splits=1, new_kv=(kn, vn, cos, sin, slots), pdl=True)
    torch.cuda.synchronize()


def gemm() -> None:
    import decode_gemm_gluon as dg
    dev = torch.device("cuda")
    x = torch.randn(256, 1536, device=dev, dtype=torch.bfloat16)
    w = torch.randn(17920, 1536, device=dev, dtype=torch.bfloat16) * 0.03
    out = torch.empty(256, 17920, device=dev, dtype=torch.bfloat16)
    dp = dg.StreamK(17920, 1536, dev, bm=128, bn=128, num_warps=4, stages=6, grid=-1)
    sk = dg.StreamK(17920, 1536, dev, bm=256, bn=128, num_warps=8, stages=4)
    for _ in range(4):
        dp(x, w, out)
        sk(x, w, out)
        torch.mm(x, w.t(), out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "attention":
        attention(int(sys.argv[2]), int(sys.argv[3]))
    else:
        gemm()
