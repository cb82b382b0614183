"""Decode attention over the paged KV cache: which cache layout, page size and kernel read it fastest.

    python bench/decode_layouts.py [--batch 256] [--contexts 512,1024] [--out bench/results/decode_layouts_<device>.json]

For each Qwen2.5 attention shape (0.5B 14/2 heads of 64, 1.5B 12/2 of 128, 7B 28/4 of 128), bf16 caches with shuffled
block tables, and these candidates:
- `triton`: lathe's paged kernel (`triton_decode.paged_decode`) over the engine's token-major cache
  (num_blocks, page, kv_heads, head_dim) and over a head-major one (num_blocks, kv_heads, page, head_dim: a head's
  page is one contiguous run), pages of 16, 32 and 64 tokens, a small grid of tile and launch settings;
- `flex`: FlexAttention (compiled) over the token-major cache, the page table as its block mask (full pages as full
  blocks, the last partial page masked by `kv % page < rest`);
- `cudnn` / `flash`: SDPA on a contiguous, unpaged cache of the same tokens: what a kernel reads at best here.
Each: the median time (triton.testing.do_bench), the bandwidth (K and V bytes over time) and the error against the
PyTorch reference (`paged_attention.decode_attention` in float32).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

from lathe.engine.paged_attention import decode_attention  # noqa: E402
from lathe.engine.triton_decode import paged_decode  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def flex_decoder(page: int):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)

    def run(q, kc, vc, tables, lens):
        b, width = tables.shape
        nslots = kc.shape[0] * page
        k = kc.view(1, nslots, *kc.shape[2:]).transpose(1, 2)        # (1, Hkv, slots, D), strided
        v = vc.view(1, nslots, *vc.shape[2:]).transpose(1, 2)
        full = lens // page
        rest = lens - full * page
        pages = kc.shape[0]             # the mask spans every physical page (flex's KV length)
        full_idx = F.pad(tables.int(), (0, pages - width))
        part_idx = torch.zeros_like(full_idx)                           # only column 0 is read
        part_idx[:, :1] = tables.gather(1, full.clamp(max=width - 1)[:, None].long())
        mask = BlockMask.from_kv_blocks(
            (rest > 0).int().view(b, 1, 1), part_idx.view(b, 1, 1, pages),
            full.int().view(b, 1, 1), full_idx.view(b, 1, 1, pages), BLOCK_SIZE=(128, page),
            mask_mod=lambda bi, h, qi, kv: (kv % page) < rest[bi], seq_lengths=(1, nslots), compute_q_blocks=False)
        out = flex(q[:, :, None, :], k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1), block_mask=mask,
                   enable_gqa=True)
        return out[:, :, 0, :]
    return run


def main() -> None:
    import triton
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="512,1024")
    ap.add_argument("--pages", default="16,32,64")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {**result_header("decode_layouts", device, args, triton=triton.__version__), "shapes": {}}
    g = torch.Generator(device=device).manual_seed(0)
    b = args.batch

    def measure(fn, ref, nbytes, **info):
        try:
            err = float((fn().float() - ref).norm() / ref.norm())
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as e:          # a configuration that does not build here is recorded, not fatal
            return {**info, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        return {**info, "ms": ms, "tb_s": nbytes / ms / 1e9, "rel_err": err}

    for shape, (hq, hkv, dim) in SHAPES.items():
        for ctx in map(int, args.contexts.split(",")):
            rows = []
            nbytes = 2 * b * ctx * hkv * dim * 2
            q = torch.randn(b, hq, dim, device=device, dtype=torch.bfloat16, generator=g)
            lens = torch.full((b,), ctx, device=device, dtype=torch.int32)
            lens[::3] -= 5                       # partial last pages too
            nbytes_real = 2 * int(lens.sum()) * hkv * dim * 2
            for page in map(int, args.pages.split(",")):
                per = -(-ctx // page)
                blocks = b * per + 1
                kc = torch.randn(blocks, page, hkv, dim, device=device, dtype=torch.bfloat16, generator=g)
                vc = torch.randn_like(kc)
                tables = torch.randperm(blocks - 1, device=device, generator=g)[:b * per].view(b, per).int()
                r = decode_attention(q.float(), kc.float(), vc.float(), tables.long(), lens)
                # head-major copies of the same cache, passed to the kernel as permuted views
                kh = kc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                vh = vc.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                for (layout, kk, vv), bn, warps, stages in itertools.product(
                        (("token", kc, vc), ("head", kh, vh)), (32, 64, 128), (2, 4, 8), (3,)):
                    fn = lambda: paged_decode(q, kk, vv, tables, lens, block_n=bn, num_warps=warps,  # noqa: E731
                                              num_stages=stages)
                    rows.append(measure(fn, r, nbytes_real, kernel="triton", layout=layout, page=page, block_n=bn,
                                        num_warps=warps, num_stages=stages))
                fl = flex_decoder(page)
                rows.append(measure(lambda: fl(q, kc, vc, tables, lens), r, nbytes_real, kernel="flex",  # noqa: B023
                                    layout="token", page=page))
                del kc, vc, kh, vh
            # unpaged: the same tokens contiguous per sequence (no padding mask: all ctx tokens, lens ignored)
            kcont = torch.randn(b, hkv, ctx, dim, device=device, dtype=torch.bfloat16, generator=g)
            vcont = torch.randn_like(kcont)
            rc = F.scaled_dot_product_attention(q[:, :, None].float(), kcont.float(), vcont.float(), enable_gqa=True)
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                from torch.nn.attention import SDPBackend, sdpa_kernel

                def fn(backend=backend):
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        return F.scaled_dot_product_attention(q[:, :, None], kcont, vcont, enable_gqa=True)
                rows.append(measure(fn, rc, nbytes, kernel=backend.split("_")[0].lower(), layout="contiguous",
                                    page=None))
            ok = [x for x in rows if "ms" in x]
            best = {}
            for x in ok:
                key = f"{x['kernel']}_{x['layout']}_{x['page']}"
                if key not in best or x["ms"] < best[key]["ms"]:
                    best[key] = x
            engine = next((x for x in ok if x["kernel"] == "triton" and x["layout"] == "token" and x["page"] == 16
                           and (x["block_n"], x["num_warps"], x["num_stages"]) == (64, 4, 3)), None)
            res["shapes"][f"{shape}_ctx{ctx}"] = {"heads": [hq, hkv, dim], "engine_default": engine, "best": best,
                                                  "all": rows}
            print(f"== {shape} ctx {ctx}: engine {engine and round(engine['tb_s'], 2)} TB/s", flush=True)
            for k, x in sorted(best.items(), key=lambda kv: kv[1]["ms"]):
                print(f"   {k:28s} {x['ms'] * 1e3:7.1f} us {x['tb_s']:.2f} TB/s err {x['rel_err']:.1e} "
                      f"{ {k2: x[k2] for k2 in ('block_n', 'num_warps', 'num_stages') if k2 in x} }", flush=True)
            for x in rows:
                if "error" in x and x["kernel"] != "triton":
                    print("   error", x, flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
