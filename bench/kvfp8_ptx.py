"""Probe (issue 48, for the record, removed in the next commit): compile a triton_decode.py's `_decode_kernel` for
sm_90 on a CPU (Triton's ptxas, no GPU), with the alignment the runtime specialises on at 1.5B's launch, and count the
PTX ops of interest (byte loads from shared memory, ldmatrix, conversions). The device's Triton was 3.6.0:

    pip install --no-deps --target /tmp/tr36 triton==3.6.0
    PYTHONPATH=/tmp/tr36 TRITON_INTERPRET=0 python bench/kvfp8_ptx.py FILE..."""
import collections, importlib.util, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def load(path):
    spec = importlib.util.spec_from_file_location("tdx_" + re.sub(r"\W", "_", path), path)
    m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m); return m

def compile_decode(mod, fp8=True, new_kv=False, splits=5, group=6, dtype="*bf16"):
    fp8t, scale = "*fp8e4nv", "*fp32"
    types = {**{n: dtype for n in ("Q", "OUT", "KN", "VN", "COS", "SIN", "SINKS")},
             "K": fp8t if fp8 else dtype, "V": fp8t if fp8 else dtype,
             **{n: scale for n in ("KS", "VS", "O", "M", "L")}, **{n: "*i32" for n in ("BT", "LENS", "COUNT", "PLEN")},
             "SLOTS": "*i64", "scale": "fp32"}
    ce = {"GROUP": group, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
          "NUM_SPLITS": splits, "NEW_KV": new_kv, "PDL": False, "HAS_SINKS": False, "KV_FP8": fp8, "PREFIX_SPLITS": 0}
    names = [n for n in mod._decode_kernel.arg_names if n not in ce]
    sig = {**{n: types.get(n, "i32") for n in names}, **{n: "constexpr" for n in ce}}
    # what the runtime specialises on the 1.5B launch: pointers 16-byte aligned, strides that are multiples of 16
    ints16 = {"stride_qb", "stride_qh", "stride_kblock", "stride_ktok", "stride_kh", "stride_ob", "stride_os",
              "stride_oh", "stride_mb", "stride_ms", "stride_outb", "stride_outh", "stride_knh", "stride_vnh",
              "stride_sblock"}
    order = list(mod._decode_kernel.arg_names)
    attrs = {(order.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in ints16}
    return triton.compile(ASTSource(fn=mod._decode_kernel, signature=sig, constexprs=ce, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})

def loop_ops(ptx):
    ops = collections.Counter(re.findall(r"^\s+(?:@%p\d+\s+)?([a-z][\w.]*)", ptx, re.M))
    keys = ("ld.shared.b8", "ld.shared", "ldmatrix", "stmatrix", "st.shared", "cvt", "prmt", "mma", "cp.async.c", "bar.sync")
    return sum(ops.values()), {k: sum(v for o, v in ops.items() if o.startswith(k)) for k in keys}

if __name__ == "__main__":
    for path in sys.argv[1:]:
        mod = load(path)
        for fp8 in (False, True):
            ck = compile_decode(mod, fp8=fp8)
            total, ops = loop_ops(ck.asm["ptx"])
            print(path.split("/")[-1], "fp8" if fp8 else "bf16", total, ops, "regs", ck.n_regs if hasattr(ck, "n_regs") else "?")
