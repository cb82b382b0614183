"""Probe (issue 48, for the record, removed in the next commit): write variants of triton_decode.py's FP8 tile loop
into DIR (default gpu_tmp/variants/): td_u16.py (V's e4m3 pairs read as 16-bit words and widened in registers, bf16
products) and td_f16.py (that, with float16 products: q scaled into float16's range once a program, the probabilities
by s_v over the tile's largest s_v). For bench/kvfp8_ptx.py and bench/kv_fp8_decode.py --kernel."""
import sys
import os
SRC = open("src/lathe/engine/triton_decode.py").read()
DIR = sys.argv[1] if len(sys.argv) > 1 else "gpu_tmp/variants"
V_OLD = """            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
                if Q.dtype.element_ty == tl.float16:    # p x s_v would fall into float16's subnormals: scale V
                    pv = tl.dot(p.to(tl.float16), (v.to(tl.float32) * v_s[:, None]).to(tl.float16))
                else:
                    pv = tl.dot((p * v_s[None, :]).to(Q.dtype.element_ty), v.to(Q.dtype.element_ty))
            else:
                pv = tl.dot(p.to(v.dtype), v)
"""
assert V_OLD in SRC
U16 = """            if KV_FP8:      # V's e4m3 pairs as 16-bit words, widened in registers (no 8-bit transposed reads)
                half = tl.arange(0, DIM_PAD // 2)
                v_off = (tok[:, None] + h * stride_kh) // 2 + half[None, :]
                v_ok = n_ok[:, None] & (half < HEAD_DIM // 2)[None, :]
                w = tl.load(V.to(tl.pointer_type(tl.uint16)) + v_off, mask=v_ok, other=0)
                lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)
                hi = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(Q.dtype.element_ty)
                v = tl.reshape(tl.join(lo, hi), [BLOCK_N, DIM_PAD])
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
                if Q.dtype.element_ty == tl.float16:    # p x s_v would fall into float16's subnormals: scale V
                    pv = tl.dot(p.to(tl.float16), (v.to(tl.float32) * v_s[:, None]).to(tl.float16))
                else:
                    pv = tl.dot((p * v_s[None, :]).to(Q.dtype.element_ty), v)
            else:
                v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                pv = tl.dot(p.to(v.dtype), v)
"""
def write(name, s):
    os.makedirs(DIR, exist_ok=True)
    open(f"{DIR}/td_{name}.py", "w").write(s)
s = SRC.replace(V_OLD, U16)
# `tok` must be visible: _kv_tile returns it folded into kv_off; recompute it here from block and n
s = s.replace("""                half = tl.arange(0, DIM_PAD // 2)
""", """                half = tl.arange(0, DIM_PAD // 2)
                tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok
""")
write("u16", s)
print("written")

# f16: products in float16 over an FP8 cache (e4m3 -> f16 is one cvt a pair on sm_90; -> bf16 three): q scaled into
# float16's range once per program, K and V exact in float16, V's pairs read as 16-bit words, the probabilities scaled by
# s_v / (the tile's largest s_v), that largest multiplying the tile's product
LOOP_HEAD = """        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
"""
assert LOOP_HEAD in SRC
F16_HEAD = LOOP_HEAD + """        if KV_FP8:      # q in float16 for the products, scaled into its range (qs >= 1 multiplies the scores back)
            qs = tl.maximum(tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0) * (1.0 / 16384.0), 1.0)
            q16 = (q.to(tl.float32) / qs).to(tl.float16)
"""
K_OLD = """            if KV_FP8:      # e4m3 -> q's dtype is exact; the scales multiply the scores (module doc)
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
                scores = tl.dot(q, tl.trans(k.to(Q.dtype.element_ty))).to(tl.float32) * (k_s * scale)[None, :]
"""
assert K_OLD in SRC
K_F16 = """            if KV_FP8:      # e4m3 -> float16 is exact; the scales multiply the scores
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
                scores = tl.dot(q16, tl.trans(k.to(tl.float16))).to(tl.float32) * (k_s * (scale * qs))[None, :]
"""
V_F16 = """            if KV_FP8:      # V's e4m3 pairs as 16-bit words, widened to float16 in registers
                tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok
                half = tl.arange(0, DIM_PAD // 2)
                v_off = (tok[:, None] + h * stride_kh) // 2 + half[None, :]
                v_ok = n_ok[:, None] & (half < HEAD_DIM // 2)[None, :]
                w = tl.load(V.to(tl.pointer_type(tl.uint16)) + v_off, mask=v_ok, other=0)
                lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
                hi = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
                v = tl.reshape(tl.join(lo, hi), [BLOCK_N, DIM_PAD])
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
                v_top = tl.maximum(tl.max(v_s, 0), 1e-30)
                pv = tl.dot((p * (v_s / v_top)[None, :]).to(tl.float16), v) * v_top
            else:
                v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                pv = tl.dot(p.to(v.dtype), v)
"""
s = SRC.replace(LOOP_HEAD, F16_HEAD, 1).replace(K_OLD, K_F16).replace(V_OLD, V_F16)
write("f16", s)
print("written f16")
