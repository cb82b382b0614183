"""Decode attention where a decode step runs it: between the layer's q/k/v projection and its output projection.

    python bench/decode_attention_situ.py [--models 0.5b,1.5b] [--contexts 16,256,512,768] [--configs 64:4:3,64:4:3:2]
                                          [--kernels new=src,pdl=src+pdl,old=.ab/old_triton_decode.py] [--rounds 2]
                                          [--out F]

Four CUDA graphs per (model, context, kernel, launch setting), batch 256, every row at the same context (as the fixed
load's rows are at any one step), a distinct KV cache and distinct weights per layer (none of it stays in L2):
- `plain`: the paged kernel launched once per layer, back to back, cache only (bench/decode_attention_graph.py);
- `new_kv`: the same with the step's own token (RoPE, K/V store and attention in one launch, as the engine runs it);
- `situ`: per layer the q/k/v projection (cuBLAS, with bias), the kernel with the new token, the output projection;
- `gemms`: the two projections alone (the output projection reads q in the attention output's place).
`situ - gemms` is attention's cost inside the step; against `new_kv` it shows what the kernel loses to its
neighbours (the cache's first loads after a GEMM, the GEMM's tail). Median microseconds per layer over 20 replays
and K/V bandwidth. `--kernels` names triton_decode modules to compare in the same process (`src`: the installed
lathe's; `+pdl`: launched with `pdl=True`, as a programmatic dependent of the launch before it); rounds interleave them.
`--configs`: block_n:num_warps:num_stages[:num_splits] of the kernel (one split unless given; the engine picks splits
by `choose_num_splits`).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import SHAPES, graph_step_us, result_header, write_result  # noqa: E402



def load_kernel(spec: str):
    if spec == "src":
        from lathe.engine import triton_decode
        return triton_decode
    module_spec = importlib.util.spec_from_file_location(f"triton_decode_{abs(hash(spec))}", spec)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def compiled_variants(module) -> list[dict]:
    """Registers, spills and shared memory of each compiled variant of the module's decode kernel (Triton's JIT
    cache; empty where this Triton keeps it elsewhere). Registers decide how many programs an SM holds."""
    out = []
    try:
        for cache in module._decode_kernel.device_caches.values():
            for kernel in cache[0].values():
                kernel._init_handles()
                consts = {k[0] if isinstance(k, tuple) else k: v
                          for k, v in getattr(kernel.src, "constants", {}).items()}
                out.append({"n_regs": kernel.n_regs, "n_spills": kernel.n_spills, "shared": kernel.metadata.shared,
                            "num_warps": kernel.metadata.num_warps, "num_stages": kernel.metadata.num_stages,
                            "constants": {str(k): v for k, v in consts.items() if not hasattr(v, "dtype")}})
    except Exception as e:      # noqa: BLE001 - a report, not a requirement
        out.append({"error": repr(e)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--contexts", default="16,256,512,768")
    ap.add_argument("--configs", default="64:4:3,64:2:3")
    ap.add_argument("--kernels", default="new=src")
    ap.add_argument("--modes", default="plain,new_kv,situ,gemms")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    specs = dict(kv.split("=", 1) for kv in args.kernels.split(","))
    kernels = {name: load_kernel(spec.removesuffix("+pdl")) for name, spec in specs.items()}
    modes = args.modes.split(",")
    g = torch.Generator(device=dev).manual_seed(0)
    b, page = args.batch, 16
    rows = {}
    for m in args.models.split(","):
        shape = SHAPES[m]
        hq, hkv, layers = shape["num_attention_heads"], shape["num_key_value_heads"], shape["num_hidden_layers"]
        dim = shape["hidden_size"] // hq
        hidden, width = hq * dim, (hq + 2 * hkv) * dim
        w_qkv = [torch.randn(width, hidden, device=dev, dtype=torch.bfloat16, generator=g) * hidden ** -0.5
                 for _ in range(layers)]
        b_qkv = [torch.randn(width, device=dev, dtype=torch.bfloat16, generator=g) * 0.1 for _ in range(layers)]
        w_o = [torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16, generator=g) * hidden ** -0.5
               for _ in range(layers)]
        x0 = torch.randn(b, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        cos = torch.randn(b, dim, device=dev, dtype=torch.bfloat16, generator=g)
        sin = torch.randn(b, dim, device=dev, dtype=torch.bfloat16, generator=g)
        for ctx in map(int, args.contexts.split(",")):
            per = -(-ctx // page)
            blocks = b * per + 1
            kcs = [torch.randn(blocks, page, hkv, dim, device=dev, dtype=torch.bfloat16, generator=g)
                   for _ in range(layers)]
            vcs = [torch.randn_like(k) for k in kcs]
            tables = torch.randperm(blocks - 1, device=dev, generator=g)[:b * per].view(b, per).int()
            lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
            slots = (tables[:, (ctx - 1) // page].long() * page + (ctx - 1) % page).contiguous()
            q_alone = torch.randn(b, hq, dim, device=dev, dtype=torch.bfloat16, generator=g)
            kv_bytes = 2 * b * ctx * hkv * dim * 2
            for rnd in range(args.rounds):
                for cfg in args.configs.split(","):
                    bn, nw, ns, splits = (list(map(int, cfg.split(":"))) + [1])[:4]     # block_n:warps:stages[:splits]
                    counters = torch.zeros(b * hkv, dtype=torch.int32, device=dev)
                    for kname, mod in kernels.items():
                        pdl = {"pdl": True} if specs[kname].endswith("+pdl") else {}

                        def attend(i, q, k=None, v=None):
                            new_kv = None if k is None else (k, v, cos, sin, slots)
                            return mod.paged_decode(q, kcs[i], vcs[i], tables, lens, block_n=bn, num_warps=nw,
                                                    num_stages=ns, new_kv=new_kv, num_splits=splits,
                                                    counters=counters if splits > 1 else None, **pdl)

                        def step(mode):
                            x = x0
                            for i in range(layers):
                                if mode == "plain":
                                    attend(i, q_alone)
                                    continue
                                qkv = F.linear(x, w_qkv[i], b_qkv[i])
                                q = qkv[:, :hidden].view(b, hq, dim)
                                k = qkv[:, hidden:hidden + hkv * dim].view(b, hkv, dim)
                                v = qkv[:, hidden + hkv * dim:].view(b, hkv, dim)
                                o = qkv[:, :hidden] if mode == "gemms" else attend(i, q, k, v).view(b, hidden)
                                x = F.linear(o, w_o[i])
                            return x

                        for mode in modes:
                            if mode == "new_kv":
                                qkv = F.linear(x0, w_qkv[0], b_qkv[0])
                                q = qkv[:, :hidden].view(b, hq, dim)
                                k = qkv[:, hidden:hidden + hkv * dim].view(b, hkv, dim)
                                v = qkv[:, hidden + hkv * dim:].view(b, hkv, dim)
                                launches = lambda: [attend(i, q, k, v) for i in range(layers)]   # noqa: E731
                                us = graph_step_us(launches, 20, steps=1) / layers
                            else:
                                us = graph_step_us(lambda: step(mode), 20, steps=1) / layers
                            key = f"{m}_ctx{ctx}_{cfg}_{kname}_{mode}"
                            row = rows.setdefault(key, {"us_per_layer": []})
                            row["us_per_layer"].append(round(us, 2))
                            if mode in ("plain", "new_kv"):
                                row.setdefault("tb_s", []).append(round(kv_bytes / us / 1e6, 3))
                            print(f"round {rnd} {key}: {us:.2f} us/layer", flush=True)
            kcs = vcs = None
            torch.cuda.empty_cache()
    for key, row in rows.items():       # attention inside the step: situ - gemms, per round
        if key.endswith("_situ"):
            base = rows.get(key[:-len("situ")] + "gemms")
            if base:
                row["attention_us"] = [round(a - c, 2) for a, c in zip(row["us_per_layer"], base["us_per_layer"])]
    kernels_info = {name: compiled_variants(mod) for name, mod in kernels.items()}
    for name, info in kernels_info.items():
        print(name, info, flush=True)
    result = {**result_header("decode_attention_situ", dev, args), "kernels": kernels_info, "rows": rows}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
