"""Writes the FP8 decode kernel's "bits" variant (kv_fp8_decode_bits_ab_nvidia-h200.json's arm fp8_td_bits): committed
for the record as it ran, removed by the next commit.

    python bench/kv_fp8_bits_variant.py OUT.py      # from src/lathe/engine/triton_decode.py at 2a6737f

K and V are read as 16-bit words and each e4m3 value's sign and 7 exponent-mantissa bits are placed in a bf16's (the
value x 2^-120, subnormals included; q x 2^64 and the scales x 2^56 undo it), so the loop has no conversion
instruction. Only for a bf16 q (float16 and float32 keep the kernel's own path).
"""
import sys
from pathlib import Path

EDITS = [
    ("""            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if KV_FP8:      # e4m3 -> q's dtype is exact; the scales multiply the scores (module doc)
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
                scores = tl.dot(q, tl.trans(k.to(Q.dtype.element_ty))).to(tl.float32) * (k_s * scale)[None, :]
            else:""",
     """            if KV_FP8:
                half = tl.arange(0, DIM_PAD // 2)
                tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok + h * stride_kh
                w_off = tok[:, None] // 2 + half[None, :]
                w_ok = n_ok[:, None] & (half < HEAD_DIM // 2)[None, :]
                s_off = block.to(tl.int64) * stride_sblock + (n % PAGE) * stride_stok + h
                k_s = tl.load(KS + s_off, mask=n_ok, other=0.0)
            if KV_FP8 and BITS:
                wk = tl.load(K.to(tl.pointer_type(tl.uint16)) + w_off, mask=w_ok, other=0)
                k = _e4m3_words_bf16(wk, BLOCK_N, DIM_PAD)
                scores = tl.dot(q_big, tl.trans(k)).to(tl.float32) * (k_s * (scale * 72057594037927936.0))[None, :]
            elif KV_FP8:      # e4m3 -> q's dtype is exact; the scales multiply the scores (module doc)
                k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
                scores = tl.dot(q, tl.trans(k.to(Q.dtype.element_ty))).to(tl.float32) * (k_s * scale)[None, :]
            else:
                k = tl.load(K + kv_off, mask=kv_mask, other=0.0)"""),
    ("""            if KV_FP8:      # V's e4m3 pairs read as 16-bit words and widened in registers (module doc)
                half = tl.arange(0, DIM_PAD // 2)
                tok = block.to(tl.int64) * stride_kblock + (n % PAGE) * stride_ktok + h * stride_kh
                w = tl.load(V.to(tl.pointer_type(tl.uint16)) + (tok[:, None] // 2 + half[None, :]),
                            mask=n_ok[:, None] & (half < HEAD_DIM // 2)[None, :], other=0)
                lo""",
     """            if KV_FP8 and BITS:
                wv = tl.load(V.to(tl.pointer_type(tl.uint16)) + w_off, mask=w_ok, other=0)
                v = _e4m3_words_bf16(wv, BLOCK_N, DIM_PAD)
                v_s = tl.load(VS + s_off, mask=n_ok, other=0.0)
                pv = tl.dot((p * (v_s * 18446744073709551616.0)[None, :]).to(tl.bfloat16), v).to(tl.float32) \\
                    * 72057594037927936.0
            elif KV_FP8:      # V's e4m3 pairs read as 16-bit words and widened in registers (module doc)
                w = tl.load(V.to(tl.pointer_type(tl.uint16)) + w_off, mask=w_ok, other=0)
                lo"""),
    ("""        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start_n""",
     """        BITS: tl.constexpr = KV_FP8 and Q.dtype.element_ty == tl.bfloat16
        if BITS:    # e4m3 bits placed in bf16's are the value x 2^-120: q x 2^64 keeps the products normal
            q_big = (q.to(tl.float32) * 18446744073709551616.0).to(tl.bfloat16)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start_n"""),
    ("""    @triton.jit
    def _kv_tile(""",
     """    @triton.jit
    def _e4m3_words_bf16(w, BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr):
        \"\"\"[BLOCK_N, DIM_PAD // 2] 16-bit words of e4m3 pairs -> [BLOCK_N, DIM_PAD] bf16 holding each value x 2^-120:
        the sign and the 7 exponent-mantissa bits moved into bf16's places (subnormals included), no conversion.\"\"\"
        w = w.to(tl.uint32)
        lo = (((w & 0x80) << 8) | ((w & 0x7F) << 4)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = ((w & 0x8000) | ((w >> 4) & 0x7F0)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(tl.join(lo, hi), [BLOCK_N, DIM_PAD])

    @triton.jit
    def _kv_tile("""),
]

if __name__ == "__main__":
    text = (Path(__file__).resolve().parents[1] / "src" / "lathe" / "engine" / "triton_decode.py").read_text()
    for old, new in EDITS:
        assert text.count(old) == 1, old[:80]
        text = text.replace(old, new)
    Path(sys.argv[1]).write_text(text)
