"""The MoE layer's expert matmuls at decode sizes, on one GPU: how close torch's grouped matmul comes to the HBM
bandwidth, per weight layout, and what the rest of lathe's expert path (sort, gather, scatter, sum) adds.

    python bench/moe_gemm.py [--shape 30b-a3b|gpt-oss-20b] [--rows 1,8,32,128,256,512]
                             [--out bench/results/moe_gemm_[<shape>_]<device>.json]

For each decode batch (rows = sequences, one token each) the router's choices are drawn at random (top-k of E
distinct experts per row), so the experts a step touches follow the expected count E (1 - (1 - k/E)^rows). Timed with
CUDA events over `--iters` calls after a warm-up, each variant on the same rows and choices:
- `grouped_nn_weights` (lathe's layout): `torch._grouped_mm(x, w.transpose(1, 2))` with w (E, out, in) as
  nn.Linear stores it, both projections;
- `grouped_kn_weights`: the same product with the weights stored (E, in, out) contiguous;
- `experts_forward`: lathe's whole expert path (`lathe.models.moe.experts_forward`: sort by expert, gather, the two
  grouped matmuls with SwiGLU, scatter back, weighted sum over k);
- `triton_fused`: the engine's decode path for the same sum (`lathe.engine.triton_moe.fused_experts`: a small sort,
  then two Triton launches that gather rows by index, apply SwiGLU and the routing weights inside, and a sum over k),
  autotuned in its warm-up calls.
For a GPT-OSS shape (`--shape gpt-oss-20b`) the model's own form is timed: `experts_forward` and `triton_fused` read
its input-major tensors (E, H, 2I) and (E, I, H) as transposed views, with biases and the clamped SwiGLU over
interleaved gate/up columns (alpha 1.702, limit 7), as `lathe.models.gpt_oss.GptOssExperts` holds and runs them.
The figure is the touched experts' weight bytes over the time (TB/s), against the HBM datasheet bandwidth;
`triton_fused` also records its norm-relative difference from `experts_forward` (bfloat16 rounding: ~1e-2 or less).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import SHAPES, device_name, git_sha, hbm_bandwidth, slug  # noqa: E402

from lathe.engine.triton_moe import fused_experts, last_configs  # noqa: E402
from lathe.models.gpt_oss import clamped_swiglu  # noqa: E402
from lathe.models.moe import experts_forward  # noqa: E402


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def timed(fn, iters: int) -> float:
    """Mean seconds per call of fn (CUDA events, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run(args) -> dict:
    shape = SHAPES[args.shape]
    gpt_oss = shape.get("model_type") == "gpt_oss"      # its `intermediate_size` is each expert's width
    h, inter, e, k = (shape["hidden_size"], shape["intermediate_size" if gpt_oss else "moe_intermediate_size"],
                      shape["num_experts"], shape["num_experts_per_tok"])
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * inter, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    down = torch.randn(e, h, inter, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    gate_up_kn, down_kn = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    # the model's own tensors and extras: (gate_up, down) as experts_forward takes them, biases, (alpha, limit)
    model_gate_up, model_down, biases, clamp, act = gate_up, down, None, None, None
    if gpt_oss:
        model_gate_up, model_down = gate_up_kn.transpose(1, 2), down_kn.transpose(1, 2)
        biases = tuple(torch.randn(e, n, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
                       for n in (2 * inter, h))
        clamp = (1.702, 7.0)
        act = functools.partial(clamped_swiglu, alpha=clamp[0], limit=clamp[1])
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * 2
    bw = hbm_bandwidth(device_name(dev))
    out = []
    for rows in args.rows:
        x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16, generator=gen)
        chosen = torch.rand(rows, e, device=dev, generator=gen).topk(k, dim=-1).indices
        weights = torch.rand(rows, k, device=dev, generator=gen).softmax(-1).to(torch.bfloat16)
        experts, order = chosen.reshape(-1).sort(stable=True)
        sorted_rows = x.index_select(0, order // k)
        offs = torch.searchsorted(experts, torch.arange(1, e + 1, device=dev)).to(torch.int32)
        touched = int(experts.unique().numel())

        def nn_layout():
            hid = torch._grouped_mm(sorted_rows, gate_up.transpose(1, 2), offs=offs)
            return torch._grouped_mm(swiglu(hid), down.transpose(1, 2), offs=offs)

        def kn_layout():
            hid = torch._grouped_mm(sorted_rows, gate_up_kn, offs=offs)
            return torch._grouped_mm(swiglu(hid), down_kn, offs=offs)

        def whole():
            return experts_forward(x, weights, chosen, model_gate_up, model_down, biases, act)

        def fused():
            return fused_experts(x, weights, chosen, model_gate_up, model_down, biases, clamp)

        row = {"rows": rows, "touched_experts": touched,
               "expected_touched": e * (1 - (1 - k / e) ** rows), "touched_bytes": touched * expert_bytes}
        variants = (("grouped_nn_weights", nn_layout), ("grouped_kn_weights", kn_layout),
                    ("experts_forward", whole), ("triton_fused", fused))
        for name, fn in variants:
            sec = timed(fn, args.iters)
            row[name] = {"us": sec * 1e6, "tb_s": touched * expert_bytes / sec / 1e12,
                         "hbm_fraction": touched * expert_bytes / sec / bw}
        ref = whole().float()
        row["triton_fused"]["rel_error"] = float((fused().float() - ref).norm() / ref.norm())   # vs experts_forward
        row["triton_fused"]["configs"] = last_configs()
        out.append(row)
        times = "; ".join(f"{n} {row[n]['us']:.0f} us {row[n]['tb_s']:.2f} TB/s" for n, _ in variants)
        fused_row = row["triton_fused"]
        print(f"rows {rows:4d}: {touched:3d} experts; {times}; fused rel. error {fused_row['rel_error']:.1e}, "
              f"tiles {fused_row['configs']}", flush=True)
    return {"shape": args.shape, "expert_bytes": expert_bytes, "hbm_bytes_per_s": bw, "results": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="30b-a3b")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128, 256, 512])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--git-sha", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    name = device_name(torch.device("cuda"))
    result = {"bench": "moe_gemm", "device": name,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
              **run(args)}
    tag = "" if args.shape == "30b-a3b" else f"{slug(args.shape)}_"     # (the 30B-A3B files keep their names)
    out = Path(args.out or ROOT / "bench" / "results" / f"moe_gemm_{tag}{slug(name)}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
