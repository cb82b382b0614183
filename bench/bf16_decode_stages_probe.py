"""Probe: the bf16 decode kernel with 2 and 3 pipeline stages (and block_n 32), by shape, rounds interleaved."""
import json, math, statistics, sys, torch, triton
from lathe.engine import triton_decode
dev = torch.device("cuda"); out = {}
SH = [("1.5b_256x512", 256, 12, 2, 512), ("1.5b_256x768", 256, 12, 2, 768), ("0.5b_256x512", 256, 14, 2, 512),
      ("7b_256x512", 256, 28, 4, 512), ("1.5b_32x8448", 32, 12, 2, 8448), ("1.5b_64x2048", 64, 12, 2, 2048),
      ("1.5b_256x4096", 256, 12, 2, 4096), ("7b_64x512", 64, 28, 4, 512)]
for label, rows, hq, hkv, ctx in SH:
    g = torch.Generator(device=dev).manual_seed(0); page = 16; per = math.ceil(ctx / page); nb = rows * per + 1
    tables = torch.randperm(nb - 1, device=dev, generator=g)[:rows * per].view(rows, per).int()
    k = torch.randn(nb, page, hkv, 128, device=dev, dtype=torch.bfloat16, generator=g); v = torch.randn_like(k)
    q = torch.randn(rows, hq, 128, device=dev, dtype=torch.bfloat16, generator=g)
    lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)
    sp = triton_decode.choose_num_splits(rows, hkv, torch.cuda.get_device_properties(dev).multi_processor_count)
    cnt = torch.zeros(rows * hkv, dtype=torch.int32, device=dev)
    arms = {f"bn{bn}_s{s}": (lambda bn=bn, s=s: triton_decode.paged_decode(q, k, v, tables, lens, num_splits=sp, counters=cnt, block_n=bn, num_stages=s))
            for bn, s in ((64, 3), (64, 2), (32, 3), (32, 2))}
    ref = arms["bn64_s3"](); t = {a: [] for a in arms}
    for a, f in arms.items():
        assert ((f().float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2, a
    for _ in range(3):
        for a, f in arms.items():
            t[a].append(triton.testing.do_bench(f, warmup=50, rep=300) * 1e3)
    out[label] = {"splits": sp, **{a: round(statistics.median(x), 1) for a, x in t.items()}}
    print(label, out[label], flush=True)
json.dump({"probe": "bf16 decode stages", "sha": sys.argv[2], "cases": out}, open(sys.argv[1], "w"), indent=1)
