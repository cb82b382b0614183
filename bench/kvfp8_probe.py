"""Probe (issue 48, committed as it ran for the record, removed in the next commit): the Triton paged decode kernel
over a bf16 cache against an FP8 cache, and variants of the FP8 tile loop made by text edits of triton_decode.py.

    python bench/kvfp8_probe.py [VARIANTS]     # on a GPU, $OUT set; writes $OUT/kvfp8_probe.json and the IR

VARIANTS, comma-separated: noscale (no scale loads: a wrong result, a bound), early (scale loads at the top of the
loop), prefetch (scale loads one tile ahead), vscale (V's tile dequantised), vkscale (K's and V's). Its two runs on
an H200 at 4d04401: `noscale,early,prefetch` (kvfp8_probe_1) and the default (kvfp8_probe_2). Without a GPU it runs
one tiny case in Triton's interpreter (correctness of the variants only)."""
import importlib.util, json, math, os, sys, tempfile
import torch
import triton
from lathe.engine import triton_decode as td
from lathe.engine.kv_cache import quantize

src = open(td.__file__).read()
K_OLD = """            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:      # e4m3 -> q's dtype is exact; the scales multiply the scores (module doc)
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
"""
V_OLD = """            if KV_FP8:
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
"""
assert K_OLD in src and V_OLD in src
LOOP = "        for start_n in range(start, end, BLOCK_N):\n"
assert src.find(LOOP) < src.find(K_OLD)

def variant(name):
    s = src
    if name == "noscale":
        s = s.replace("k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)", "k_s = tl.where(n_ok, 1.0, 0.0)")
        s = s.replace("v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)", "v_s = tl.where(n_ok, 1.0, 0.0)")
    elif name == "early":
        s = s.replace(K_OLD, """            if KV_FP8:
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:
""")
        s = s.replace(V_OLD, "            if KV_FP8:\n")
    elif name == "prefetch":
        s = s.replace(LOOP, """        if KV_FP8:
            n0 = start + tl.arange(0, BLOCK_N)
            ok0 = n0 < end
            b0 = tl.load(BT + b * stride_bt + n0 // PAGE, mask=ok0, other=0)
            o0 = b0.to(tl.int64) * stride_sblock + (n0 % PAGE) * stride_stok + h
            k_s_next = tl.load(KS + o0, mask=ok0, other=0.0)
            v_s_next = tl.load(VS + o0, mask=ok0, other=0.0)
""" + LOOP, 1)
        s = s.replace(K_OLD, """            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:
                k_s = k_s_next
                v_s = v_s_next
                n1 = start_n + BLOCK_N + tl.arange(0, BLOCK_N)
                ok1 = n1 < end
                b1 = tl.load(BT + b * stride_bt + n1 // PAGE, mask=ok1, other=0)
                o1 = b1.to(tl.int64) * stride_sblock + (n1 % PAGE) * stride_stok + h
                k_s_next = tl.load(KS + o1, mask=ok1, other=0.0)
                v_s_next = tl.load(VS + o1, mask=ok1, other=0.0)
""")
        s = s.replace(V_OLD, "            if KV_FP8:\n")
    elif name in ("vscale", "vkscale"):
        old = """                else:
                    pv = tl.dot((p * v_s[None, :]).to(Q.dtype.element_ty), v.to(Q.dtype.element_ty))"""
        assert old in s
        s = s.replace(old, """                else:
                    pv = tl.dot(p.to(Q.dtype.element_ty), (v.to(tl.float32) * v_s[:, None]).to(Q.dtype.element_ty))""")
        if name == "vkscale":
            old = "scores = tl.dot(q, tl.trans(k.to(Q.dtype.element_ty))).to(tl.float32) * (k_s * scale)[None, :]"
            assert old in s
            s = s.replace(old, "scores = tl.dot(q, tl.trans((k.to(tl.float32) * k_s[:, None]).to(Q.dtype.element_ty)))"
                               ".to(tl.float32) * scale")
    d = tempfile.mkdtemp()
    path = os.path.join(d, f"td_{name}.py")
    open(path, "w").write(s)
    spec = importlib.util.spec_from_file_location(f"td_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

VARIANTS = sys.argv[1].split(",") if len(sys.argv) > 1 else ["noscale", "vscale", "vkscale"]
mods = {n: variant(n) for n in VARIANTS}
mods["cur"] = td
CUDA = torch.cuda.is_available()
dev = torch.device("cuda" if CUDA else "cpu")
out = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "triton": triton.__version__, "torch": torch.__version__, "cases": []}

def case(label, B, hq, hkv, ctx, page=16, dim=128):
    torch.manual_seed(0)
    blocks_per = math.ceil(ctx / page)
    nblocks = B * blocks_per + 1
    perm = torch.randperm(nblocks - 1, device=dev)[: B * blocks_per].view(B, blocks_per).int()
    k = torch.randn(nblocks, page, hkv, dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kq, ks = quantize(k); vq, vs = quantize(v)
    q = torch.randn(B, hq, dim, device=dev, dtype=torch.bfloat16)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    splits = td.choose_num_splits(B, hkv, torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 4)
    counters = torch.zeros(B * hkv, dtype=torch.int32, device=dev)
    row = {"label": label, "B": B, "hq": hq, "hkv": hkv, "ctx": ctx, "splits": splits,
           "kv_mb_bf16": 2 * B * ctx * hkv * dim * 2 / 1e6}
    ref = td.paged_decode(q, k, v, perm, lens, num_splits=splits, counters=counters)
    fns = {"bf16": lambda: td.paged_decode(q, k, v, perm, lens, num_splits=splits, counters=counters)}
    for name, mod in mods.items():
        fns["fp8_" + name] = (lambda mod=mod: mod.paged_decode(q, kq, vq, perm, lens, num_splits=splits,
                                                                counters=counters, scales=(ks, vs)))
    for name, fn in fns.items():
        o = fn()
        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
        us = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3 if CUDA else 1.0
        row[name] = {"us": round(us, 2), "err": err, "tb_s": round(row["kv_mb_bf16"] / (2 if name != "bf16" else 1) / us, 3)}
    print(json.dumps(row), flush=True)
    out["cases"].append(row)

if not CUDA:
    case("cpu", 2, 4, 2, 200, dim=32)
    sys.exit(0)
case("1.5b_long_mid", 32, 12, 2, 4352)
case("1.5b_long_end", 32, 12, 2, 8448)
case("1.5b_e2e", 256, 12, 2, 512)
case("7b_e2e", 256, 28, 4, 512)
case("7b_long", 32, 28, 4, 4352)
# the compiled kernels' IR (bf16 and current fp8), for reading offline
dump = {}
for key_fn, fn in (("cur", td._decode_kernel), *((n, m._decode_kernel) for n, m in mods.items() if n != "cur")):
    try:
        for cache in fn.device_caches.values():
            for key, ck in cache[0].items():
                dump[key_fn + " " + str(key)[:300]] = {k: ck.asm[k] for k in ("ttgir", "ptx") if k in ck.asm}
    except Exception as e:
        dump["error"] = repr(e)
OUT = os.environ["OUT"]
json.dump(out, open(f"{OUT}/kvfp8_probe.json", "w"), indent=1)
json.dump(dump, open(f"{OUT}/kvfp8_probe_ir.json", "w"))
print("kernels dumped:", len(dump))
