"""What streaming AdamW's offloaded moments through the GPU costs a step, with and without the overlap (issue 43/48).

    python bench/offload_adamw.py --numel 2e9 --steps 3 --out bench/results/offload_adamw_nvidia-h200.json

`--numel` fp32 parameters (tensors of `--tensor-numel` elements) with gradients on the device, and their AdamW moments
in pinned host memory (`OffloadedAdamW`, `fsdp_config.optimizer_offload` on FSDP2; `--chunk-numel` as it is built),
`step()` timed (the device synchronized) in three modes, each on fresh tensors of the same values:
- `overlap`: lathe's (`StreamedAdam`: copies in on one side stream, write-backs on another, the kernel on the compute
  stream, two chunks on the device);
- `serial`: `StreamedAdam.overlap = False`, every copy and kernel in order on the compute stream (as before 43/48);
- `resident`: torch's fused AdamW with the moments on the device: the floor, no copies.
Reports the median seconds a step, the moments' bytes each way, the rate each way (bytes / seconds), the device memory
a step added at its peak, and a float64 checksum of the parameters after the steps (the same in every mode).
Writes JSON (device, date, git sha, figures).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import device_name, git_sha, print_and_write, sync  # noqa: E402

from lathe.device import memory_allocated, peak_memory, reset_peak_memory  # noqa: E402
from lathe.train.master import CHUNK_NUMEL, StreamedAdam  # noqa: E402
from lathe.train.offloaded_adamw import OffloadedAdamW  # noqa: E402

HPARAMS = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def run(mode: str, args, device: torch.device) -> dict:
    sizes = [args.tensor_numel] * (args.numel // args.tensor_numel) + [args.numel % args.tensor_numel] * bool(
        args.numel % args.tensor_numel)
    params = []
    for i, n in enumerate(sizes):
        g = torch.Generator(device).manual_seed(i)
        params.append(torch.nn.Parameter(torch.randn(n, generator=g, device=device)))
        params[-1].grad = torch.randn(n, generator=g, device=device)
    opt = (torch.optim.AdamW(params, fused=device.type == "cuda", **HPARAMS) if mode == "resident"
           else OffloadedAdamW(params, chunk_numel=args.chunk_numel, **HPARAMS))
    StreamedAdam.overlap = mode != "serial"
    seconds, peaks = [], []
    try:
        for step in range(args.steps + 1):                      # the first: warm-up (moments taken, pinned)
            sync(device)
            before = memory_allocated(device)
            reset_peak_memory(device)
            start = time.perf_counter()
            opt.step()
            sync(device)
            if step:
                seconds.append(time.perf_counter() - start)
                peak = peak_memory(device)
                peaks.append(0 if peak is None else peak[0] - before)
    finally:
        StreamedAdam.overlap = True
    checksum = sum(float(p.detach().double().sum()) for p in params)
    median = statistics.median(seconds)
    moment_bytes = 2 * 4 * args.numel
    return {"seconds": [round(s, 4) for s in seconds], "median_seconds": round(median, 4),
            "gb_each_way": round(moment_bytes / 1e9, 2) if mode != "resident" else 0.0,
            "gb_per_s_each_way": round(moment_bytes / median / 1e9, 1) if mode != "resident" else None,
            "peak_added_gb": round(max(peaks) / 1e9, 3), "checksum": checksum}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=float, default=2e9, help="fp32 parameters (moments: 8 bytes each, each way)")
    p.add_argument("--tensor-numel", type=float, default=1e8)
    p.add_argument("--chunk-numel", type=lambda v: int(float(v)), default=CHUNK_NUMEL, help="OffloadedAdamW's default")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default="overlap,serial,resident")
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.numel, args.tensor_numel = int(args.numel), int(args.tensor_numel)
    device = torch.device(args.device)
    modes = {}
    for mode in args.modes.split(","):
        modes[mode] = run(mode, args, device)
        print(mode, json.dumps(modes[mode]), flush=True)
    same = len({round(m["checksum"], 6) for m in modes.values()}) == 1
    result = {"bench": "offload_adamw", "device": device_name(device), "date": datetime.date.today().isoformat(),
              "git_sha": git_sha(), "numel": args.numel, "tensor_numel": args.tensor_numel,
              "chunk_numel": args.chunk_numel, "modes": modes, "same_checksum": same,
              "what": f"AdamW over {args.numel / 1e9:.2f}B fp32 parameters, moments in pinned host memory: median step "
                      + ", ".join(f"{m} {v['median_seconds']:.3f} s" for m, v in modes.items())}
    print_and_write(result, args.out)


if __name__ == "__main__":
    main()
