"""FP8 rollout's projections at 7B decode sizes on one GPU (issue 48): where the FP8 decode step's time goes and how
the GEMM forms of `lathe.engine.fp8` compare.

    python bench/fp8_gemm.py [--rows 64,256,512] [--skip-engine] [--out bench/results/fp8_gemm_7b_<device>.json]

- `projections_28_layers_ms`: 28 layers of Qwen2.5-7B's decode projections (qkv, o, gate_up, down) at each row count,
  replayed as one CUDA graph: bf16 `F.linear` against `torch._scaled_mm` forms (row-wise scales inside the GEMM, with
  and without fast accumulation; unit (tensor-wise) scales, with and without), the activation quantiser left out,
  eager or compiled; and each projection alone, bf16 against row-wise FP8;
- `swiglu_quantize_28_layers_ms`: 28 layers' SiLU(gate) * up and its per-token quantisation at each row count, one
  CUDA graph: `fp8.swiglu_quantize`'s Triton launches (two launches of spans; one pass at 8, 16, 32 warps) against
  the torch form compiled by inductor, and SwiGLU alone; each also as the engine runs it (`_scaled`: gate and up
  unit-scale FP8 products dequantised by their scales first, `fp8.mlp_down`);
- `swapped_28_layers_ms`: each projection's unit-scale fast FP8 GEMM as it runs (x8 @ w8.T) against the same product
  computed transposed (w8 @ x8.T, another cuBLAS tile choice at decode rows), 28 layers, one graph;
- `errors`: each GPU form of `fp8.fp8_linear` at the gate_up and down shapes (rows 256, 4096; activations with
  outlier channels), norm-relative against the formula over the quantised operands in float64 (its accumulation) and
  against the exact product of the bf16 operands (e4m3's own rounding included), bf16 `F.linear` beside them;
- `engine_profile`: device time by kernel of the engine's decode (CUDA graphs, compiled layers), 256 random prompts of
  256 tokens, bf16 and fp8, over `--profile-tokens` new tokens after the prompts are cached.
The committed `fp8_gemm_7b_nvidia-h200.json` is one run of this script at 5cc121f (its SwiGLU probe then took gate and
up as the halves of one tensor).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import build_hf, device_name, git_sha, graph_seconds, slug  # noqa: E402

from lathe.engine import fp8  # noqa: E402

H, I, LAYERS = 3584, 18944, 28
SHAPES = {"qkv": (4608, H), "o": (H, H), "gate_up": (2 * I, H), "down": (H, I)}   # (out, in) of Qwen2.5-7B's


def graph_ms(fn, reps: int = 20) -> float:
    """Milliseconds a replay of `fn` captured as one CUDA graph takes (after warm-up on a side stream)."""
    return graph_seconds(fn, reps=reps) * 1e3


def projections(rows: int, dev) -> dict:
    ws = {k: [torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
          for k, (n, kk) in SHAPES.items()}
    w8 = {k: [fp8.quantize_rows(w) for w in v] for k, v in ws.items()}
    xs = {k: torch.randn(rows, kk, device=dev, dtype=torch.bfloat16) for k, (_, kk) in SHAPES.items()}
    x8 = {k: fp8.quantize_rows(x) for k, x in xs.items()}
    one = torch.ones((), device=dev)
    compiled = torch.compile(fp8.quantize_rows)

    def bf16():
        for i in range(LAYERS):
            for k in SHAPES:
                torch.nn.functional.linear(xs[k], ws[k][i])

    def form(quant=None, fast=False, unit=False):
        def run():
            for i in range(LAYERS):
                for k in SHAPES:
                    w, sw = w8[k][i]
                    a, sa = x8[k] if quant is None else quant(xs[k])
                    if unit:
                        torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                         use_fast_accum=fast)
                    else:
                        torch._scaled_mm(a, w.t(), scale_a=sa.unsqueeze(-1), scale_b=sw.unsqueeze(0),
                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
        return run
    out = {"bf16_ms": graph_ms(bf16)}
    for name, fn in {"fp8_noquant": form(), "fp8_noquant_fast": form(fast=True),
                     "fp8_eagerquant": form(fp8.quantize_rows), "fp8_compiledquant": form(compiled),
                     "fp8_compiledquant_fast": form(compiled, True), "fp8_tensorwise": form(unit=True),
                     "fp8_tensorwise_fast": form(unit=True, fast=True)}.items():
        out[name + "_ms"] = graph_ms(fn)
    for k in SHAPES:
        out[f"{k}_bf16_ms"] = graph_ms(lambda k=k: [torch.nn.functional.linear(xs[k], ws[k][i])
                                                     for i in range(LAYERS)])
        out[f"{k}_fp8_ms"] = graph_ms(lambda k=k: [torch._scaled_mm(
            x8[k][0], w8[k][i][0].t(), scale_a=x8[k][1].unsqueeze(-1), scale_b=w8[k][i][1].unsqueeze(0),
            out_dtype=torch.bfloat16) for i in range(LAYERS)])
    return out


def swiglu_forms(rows: int, dev) -> dict:
    # gate and up as two tensors, as the unfused 7B engine has them (fused: the halves of one, the same launches)
    gus = [torch.randn(2, rows, I, device=dev, dtype=torch.bfloat16).unbind(0) for _ in range(LAYERS)]
    # the engine's form (fp8.mlp_down): gate and up unit-scale products, dequantised by (x_scale, gate/up scales)
    scales = [(torch.rand(rows, device=dev) + 0.5, torch.rand(I, device=dev) + 0.5, torch.rand(I, device=dev) + 0.5)
              for _ in range(LAYERS)]
    compiled = torch.compile(lambda g, u: fp8.quantize_rows(fp8.swiglu(g, u)))
    compiled_scaled = torch.compile(lambda g, u, sx, sg, su: fp8.quantize_rows(fp8.swiglu(
        fp8.dequantize(g, sx, sg, g.dtype), fp8.dequantize(u, sx, su, u.dtype))))
    act = torch.compile(fp8.swiglu)
    out = {"compiled_ms": graph_ms(lambda: [compiled(g, u) for g, u in gus]),
           "compiled_scaled_ms": graph_ms(lambda: [compiled_scaled(g, u, *sc) for (g, u), sc in zip(gus, scales)]),
           "swiglu_only_compiled_ms": graph_ms(lambda: [act(g, u) for g, u in gus])}
    one_pass, warps = fp8.ONE_PASS, fp8.ROW_WARPS
    try:
        for form, row_warps in (("spans", None), ("one_pass", 8), ("one_pass", 16), ("one_pass", 32)):
            fp8.ONE_PASS, fp8.ROW_WARPS = form == "one_pass", row_warps or warps
            key = form if row_warps is None else f"{form}_{row_warps}w"
            out[f"triton_{key}_ms"] = graph_ms(lambda: [fp8.swiglu_quantize(g, u) for g, u in gus])
            out[f"triton_{key}_scaled_ms"] = graph_ms(lambda: [fp8.swiglu_quantize(g, u, sc)
                                                               for (g, u), sc in zip(gus, scales)])
    finally:
        fp8.ONE_PASS, fp8.ROW_WARPS = one_pass, warps
    return out


def swapped(rows: int, dev) -> dict:
    one = torch.ones((), device=dev)
    out = {}
    for k, (n, kk) in SHAPES.items():
        ws = [fp8.quantize_rows(torch.randn(n, kk, device=dev, dtype=torch.bfloat16) * 0.02)[0] for _ in range(LAYERS)]
        x8 = fp8.quantize_rows(torch.randn(rows, kk, device=dev, dtype=torch.bfloat16))[0]
        mm = lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                           use_fast_accum=True)
        out[f"{k}_ms"] = graph_ms(lambda: [mm(x8, w.t()) for w in ws])
        out[f"{k}_swapped_ms"] = graph_ms(lambda: [mm(w, x8.t()) for w in ws])
    return out


def errors(dev) -> dict:
    torch.manual_seed(0)
    res = {}
    for name in ("gate_up", "down"):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * 0.02 * (1 + torch.rand(n, 1, device=dev))).bfloat16()
        w8, sw = fp8.quantize_rows(w)
        for m in (256, 4096):
            x = torch.randn(m, k, device=dev)
            x[:, torch.randperm(k, device=dev)[:8]] *= 30           # outlier channels, as LLM activations have
            x = (x * (0.5 + torch.rand(m, 1, device=dev))).bfloat16()
            x8, sx = fp8.quantize_rows(x)
            formula = (x8.double() * sx.double()[:, None]) @ (w8.double() * sw.double()[:, None]).T
            exact = x.double() @ w.double().T
            rel = lambda y, ref: ((y.double() - ref).norm() / ref.norm()).item()   # noqa: E731
            row = {}
            for rowwise in (True, False):
                for fast in (False, True):
                    fp8.ROWWISE_GEMM, fp8.FAST_ACCUM = rowwise, fast
                    y = fp8.fp8_linear(x, w8, sw, None)
                    row[("rowwise" if rowwise else "split") + ("_fast" if fast else "")] = {
                        "accumulation_rel_err": rel(y, formula), "total_rel_err": rel(y, exact)}
            row["bf16"] = {"total_rel_err": rel(torch.nn.functional.linear(x, w), exact)}
            res[f"{name}_m{m}"] = row
    fp8.ROWWISE_GEMM, fp8.FAST_ACCUM = False, True
    return res


def engine_profile(dev, tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from lathe.engine.llm_engine import LatheEngine
    from lathe.generation import SamplingParams
    from lathe.models.hf import lathe_from_transformers
    prompts = [[int(t) for t in torch.randint(0, 150000, (256,))] for _ in range(256)]
    out = {}
    for q in ("fp8", None):
        model = lathe_from_transformers(build_hf("7b", dev, torch.bfloat16)).eval()
        torch.cuda.empty_cache()
        # the cache sized for the workload, not from free memory: what the first arm's compiled graphs keep alive
        # after `del` left the second arm one block (fp8_gemm's first run on one process)
        blocks = len(prompts) * -(-(256 + tokens) // 16) + 64
        engine = LatheEngine(model, eos_token_id=None, max_num_seqs=256, num_kv_blocks=blocks, quantization=q)
        params = SamplingParams(n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
        engine.generate(prompts, params)        # (compiles, captures, caches the prompts)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:25]
        out[str(q)] = {"device_ms": sum(e.self_device_time_total for e in events) / 1e3,
                       "top": [{"name": e.key[:140], "ms": e.self_device_time_total / 1e3, "calls": e.count}
                               for e in top]}
        del engine, model, prof
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--profile-tokens", type=int, default=128)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--only-swiglu", action="store_true", help="the SwiGLU probe alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_gemm.py times CUDA graphs and FP8 GEMMs: it needs an NVIDIA GPU")
    dev = torch.device("cuda")
    name = device_name(dev)
    result = {"bench": "fp8_gemm", "device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "git_sha": git_sha(), "torch": torch.__version__, "args": vars(args),
              "swiglu_quantize_28_layers_ms": {int(r): swiglu_forms(int(r), dev) for r in args.rows.split(",")}}
    if not args.only_swiglu:
        result.update(projections_28_layers_ms={int(r): projections(int(r), dev) for r in args.rows.split(",")},
                      swapped_28_layers_ms={int(r): swapped(int(r), dev) for r in args.rows.split(",")},
                      errors=errors(dev))
    if not args.skip_engine and not args.only_swiglu:
        result["engine_profile"] = engine_profile(dev, args.profile_tokens)
    out = Path(args.out or ROOT / "bench" / "results" / f"fp8_gemm_7b_{slug(name)}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
