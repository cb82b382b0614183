"""The decode step's matrix products at the engine's shapes: how close cuBLAS gets to reading the weights at HBM speed.

    python bench/decode_gemms.py [--tokens 256] [--out bench/results/decode_gemms_<device>.json]

For each Qwen2.5 layer projection (fused q/k/v with bias, o, fused gate/up, down) and the lm_head, at a decode batch
of `--tokens` rows, bf16: `F.linear` (what the engine runs), the same product with the residual added by the GEMM
(`torch.addmm(residual, x, W.T)`, what a compiled layer may fuse it into), and a Triton template chosen by
`torch.compile(mode="max-autotune-no-cudagraphs")` for the same static shape (`--autotune`). Each: median time
(triton.testing.do_bench), weight bandwidth (weight bytes over time) and the achieved fraction of `--bandwidth`.
A time is one launch timed alone, L2 flushed: for the small projections mostly launch and ramp (the decode graph's
own kernel times are in `bench/decode_profile.py`); the large ones show what cuBLAS reads at this row count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from train import result_header, write_result  # noqa: E402

# hidden, intermediate, q heads, kv heads, head dim, vocab
MODELS = {"0.5b": (896, 4864, 14, 2, 64, 151936), "1.5b": (1536, 8960, 12, 2, 128, 151936),
          "7b": (3584, 18944, 28, 4, 128, 152064)}


def projections(model: str) -> dict[str, tuple[int, int]]:
    """A decode layer's projections of `model`, fused as the engine runs them: {name: (K in, N out features)}."""
    h, inter, hq, hkv, d, _ = MODELS[model]
    return {"qkv": (h, (hq + 2 * hkv) * d), "o": (hq * d, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def main() -> None:
    import triton
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--models", default="0.5b,1.5b,7b")
    ap.add_argument("--autotune", action="store_true", help="also time max-autotune Triton templates (slow)")
    ap.add_argument("--bandwidth", type=float, default=3.35e12)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    res = {**result_header("decode_gemms", device, args), "models": {}}
    m = args.tokens
    for model in args.models.split(","):
        h, inter, hq, hkv, d, vocab = MODELS[model]
        shapes = {"qkv": (h, (hq + 2 * hkv) * d, True), "o": (hq * d, h, False), "gate_up": (h, 2 * inter, False),
                  "down": (inter, h, False), "lm_head": (h, vocab, False)}
        rows = {}
        for proj, (k, n, bias) in shapes.items():
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device=device, dtype=torch.bfloat16) if bias else None
            r = torch.randn(m, n, device=device, dtype=torch.bfloat16)
            wbytes = w.nbytes
            cands = {"linear": lambda: F.linear(x, w, b),  # noqa: B023
                     "addmm_residual": lambda: torch.addmm(r, x, w.t())}  # noqa: B023
            if args.autotune:
                compiled = torch.compile(lambda x, w, b: F.linear(x, w, b), mode="max-autotune-no-cudagraphs",
                                         dynamic=False)
                cands["max_autotune"] = lambda: compiled(x, w, b)  # noqa: B023
            row = {"m": m, "k": k, "n": n, "bias": bias, "weight_bytes": wbytes}
            for cand, fn in cands.items():
                try:
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    row[cand] = {"us": ms * 1e3, "tb_s": wbytes / ms / 1e9, "fraction": wbytes / ms / 1e-3 / args.bandwidth}
                except Exception as e:
                    row[cand] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows[proj] = row
            print(model, proj, {c: round(v["us"], 1) for c, v in row.items() if isinstance(v, dict) and "us" in v},
                  flush=True)
        layers = {"0.5b": 24, "1.5b": 28, "7b": 28}[model]
        per_step = sum(rows[p]["linear"]["us"] for p in ("qkv", "o", "gate_up", "down")) * layers + rows["lm_head"]["linear"]["us"]
        ideal = sum(rows[p]["weight_bytes"] for p in ("qkv", "o", "gate_up", "down")) * layers + rows["lm_head"]["weight_bytes"]
        res["models"][model] = {"projections": rows, "linear_us_per_step": per_step,
                                "weights_at_bandwidth_us_per_step": ideal / args.bandwidth * 1e6}
        print(model, f"per step: linear {per_step:.0f} us, weights at bandwidth {ideal / args.bandwidth * 1e6:.0f} us",
              flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
