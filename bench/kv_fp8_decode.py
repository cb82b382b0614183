"""The paged decode kernel over an FP8 KV cache against a bf16 one, by shape: microseconds a call and the K/V bytes
read per second (`lathe.engine.triton_decode.paged_decode`, do_bench: L2 flushed between calls, as between layers).

    python bench/kv_fp8_decode.py [--kernel FILE ...] [--shape LABEL:ROWS:HQ:HKV:CONTEXT[:DIM] ...] [--rounds N]
                                  [--splits N,... [--block-n N,...] [--stages N,...]] [--min-split N,...]
                                  [--out FILE]

Shapes: 1.5B's and 7B's heads at e2e's rollout (256 rows, 512 tokens of context) and at long contexts (32 rows, 4352
and 8448 tokens); random pages, each row's blocks scattered. `--kernel FILE` (repeatable): another `triton_decode.py`
(a previous version, `git show REV:src/lathe/engine/triton_decode.py > FILE`, or a variant) timed in the same call on
the same caches as the arm `fp8_<its file's stem>`, for an A/B of kernel versions. Each arm's error is the
norm-relative distance of its output from the bf16 cache's. Each round times every arm in turn (`--rounds`, 3); an
arm's figure is its median, its fastest round beside it (`us_min`: on an H200 some rounds of a short kernel read 2-3x
slow, `kv_decode_splits_0.5b_ab`, which a median of few rounds does not always absorb). `--splits`, `--block-n` and
`--stages` (comma lists): each launch of a split count, a tile width (64) and a number of pipeline stages (the
kernel's default) other than the engine's own adds a bf16 and an FP8 arm of lathe's kernel launched so (`bf16@s8b64`,
`fp8@s8b64t2`): the sweep behind the split choice. `--min-split` adds arms at the engine's splits with other least
split lengths (`bf16@m0`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, git_sha  # noqa: E402

from lathe.engine import triton_decode  # noqa: E402
from lathe.engine.kv_cache import quantize  # noqa: E402

# (label, rows, query heads, KV heads, context); head_dim 128 unless a --shape names it; pages of 16
CASES = [("1.5b_e2e", 256, 12, 2, 512, 128), ("1.5b_long_4352", 32, 12, 2, 4352, 128),
         ("1.5b_long_8448", 32, 12, 2, 8448, 128), ("7b_e2e", 256, 28, 4, 512, 128),
         ("7b_long_4352", 32, 28, 4, 4352, 128)]


def parse_shape(text: str) -> tuple:
    """`--shape LABEL:ROWS:HQ:HKV:CONTEXT[:DIM]` -> (label, rows, query heads, KV heads, context, head_dim)."""
    parts = text.split(":")
    try:
        if len(parts) not in (5, 6):
            raise ValueError
        label, *numbers = parts
        rows, hq, hkv, ctx, *dim = (int(n) for n in numbers)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected LABEL:ROWS:HQ:HKV:CONTEXT[:DIM], e.g. "
                                         "1.5b_e2e:256:12:2:512") from None
    dim = dim[0] if dim else 128
    if min(rows, hq, hkv, ctx, dim) < 1 or hq % hkv or dim % 2:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: sizes must be positive, HQ a multiple of HKV and DIM "
                                         "even")
    return label, rows, hq, hkv, ctx, dim


def parse_ints(text: str, least: int = 1) -> list[int]:
    """`--splits` / `--block-n` / `--stages` (positive) and `--min-split` (`least` 0): a comma list of integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < least:
        kind = "positive" if least > 0 else "non-negative"
        raise argparse.ArgumentTypeError(f"{text!r}: expected {kind} integers separated by commas, e.g. 4,8,16")
    return values


def load_kernel(path: Path):
    """A `triton_decode.py` from a file, as a module of its own (its kernels compile apart from lathe's)."""
    spec = importlib.util.spec_from_file_location(f"triton_decode_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                 # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(label: str, rows: int, hq: int, hkv: int, ctx: int, dim: int, kernels: dict, device: torch.device,
         page: int = 16, rounds: int = 3, launches: tuple = (), min_splits: tuple = ()) -> dict:
    """One shape: every arm's median time, bandwidth and error. `launches`: (splits, block_n, stages or None)
    triples, each timed for both caches with lathe's kernel besides the engine's own launch; `min_splits`: the
    engine's splits with each of these least split lengths (`paged_decode`'s `min_split`)."""
    import triton
    g = torch.Generator(device=device).manual_seed(0)
    per_row = math.ceil(ctx / page)
    num_blocks = rows * per_row + 1
    tables = torch.randperm(num_blocks - 1, device=device, generator=g)[:rows * per_row].view(rows, per_row).int()
    k = torch.randn(num_blocks, page, hkv, dim, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(num_blocks, page, hkv, dim, device=device, dtype=torch.bfloat16, generator=g)
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    q = torch.randn(rows, hq, dim, device=device, dtype=torch.bfloat16, generator=g)
    lens = torch.full((rows,), ctx, device=device, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # the engine's splits for each cache (every FP8 arm, another kernel file's too, launched with the FP8 cache's)
    splits = triton_decode.choose_num_splits(rows, hkv, sms, head_dim=dim)
    splits8 = triton_decode.choose_num_splits(rows, hkv, sms, head_dim=dim, fp8=True)
    counters = torch.zeros(rows * hkv, dtype=torch.int32, device=device)
    kv_bytes = 2 * rows * ctx * hkv * dim * 2                       # bf16 K and V a call reads
    row = {"rows": rows, "query_heads": hq, "kv_heads": hkv, "head_dim": dim, "context": ctx, "num_splits": splits,
           "num_splits_fp8": splits8, "kv_mb_bf16": kv_bytes / 1e6}
    arms = {"bf16": lambda: triton_decode.paged_decode(q, k, v, tables, lens, num_splits=splits, counters=counters)}
    for name, module in kernels.items():
        arms[name] = (lambda m=module: m.paged_decode(q, kq, vq, tables, lens, num_splits=splits8, counters=counters,
                                                     scales=(ks, vs)))
    for n, b, t in launches:
        tag = f"@s{n}b{b}" + ("" if t is None else f"t{t}")
        if (n, b, t) != (splits, 64, None):
            arms["bf16" + tag] = (lambda n=n, b=b, t=t: triton_decode.paged_decode(
                q, k, v, tables, lens, num_splits=n, block_n=b, num_stages=t, counters=counters))
        if (n, b, t) != (splits8, 64, None):
            arms["fp8" + tag] = (lambda n=n, b=b, t=t: triton_decode.paged_decode(
                q, kq, vq, tables, lens, num_splits=n, block_n=b, num_stages=t, counters=counters, scales=(ks, vs)))
    for least in min_splits:
        arms[f"bf16@m{least}"] = (lambda least=least: triton_decode.paged_decode(
            q, k, v, tables, lens, num_splits=splits, counters=counters, min_split=least))
        arms[f"fp8@m{least}"] = (lambda least=least: triton_decode.paged_decode(
            q, kq, vq, tables, lens, num_splits=splits8, counters=counters, scales=(ks, vs), min_split=least))
    ref = arms["bf16"]()
    errors = {name: rel(fn(), ref) for name, fn in arms.items()}
    times = {name: [] for name in arms}
    for _ in range(rounds):             # the arms in turn, each round: a clock that drifts in a call moves them alike
        for name, fn in arms.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3)
    for name in arms:
        us = statistics.median(times[name])
        read = kv_bytes if name.startswith("bf16") else kv_bytes // 2 + 2 * rows * ctx * hkv * 4  # e4m3 + scales
        row[name] = {"us": us, "us_min": min(times[name]), "us_rounds": times[name], "tb_s": read / us / 1e6,
                     "rel_error_vs_bf16_cache": errors[name]}
    for name in arms:
        if name != "bf16":
            row[f"{name}_vs_bf16"] = row["bf16"]["us"] / row[name]["us"]
    print(label, json.dumps({k: (round(v["us"], 1) if isinstance(v, dict) else v) for k, v in row.items()}))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel", type=Path, action="append", default=[],
                   help="another triton_decode.py, timed as the arm fp8_<its stem> (repeatable)")
    p.add_argument("--shape", action="append", default=[], type=parse_shape,
                   metavar="LABEL:ROWS:HQ:HKV:CONTEXT[:DIM]",
                   help="time this shape in place of the built-in ones (repeatable; DIM: head_dim, 128)")
    p.add_argument("--splits", type=parse_ints, default=None, help="split counts to time besides the engine's")
    p.add_argument("--block-n", type=parse_ints, default=None, help="tile widths to time with them (64)")
    p.add_argument("--stages", type=parse_ints, default=None, help="pipeline stages to time with them (the default)")
    p.add_argument("--min-split", type=lambda t: parse_ints(t, least=0),
                   default=[], help="least split lengths to time at the engine's splits (0: none), both caches")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every arm in turn; the median is reported")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if (args.block_n or args.stages) and not args.splits:
        p.error("--block-n and --stages go with --splits")
    launches = tuple((n, b, t) for n in (args.splits or []) for b in (args.block_n or [64])
                     for t in (args.stages or [None]))
    if not torch.cuda.is_available():
        raise SystemExit("kv_fp8_decode.py times CUDA kernels: run it on a GPU")
    device = torch.device("cuda")
    kernels = {"fp8": triton_decode}
    for path in args.kernel:
        kernels[f"fp8_{path.stem}"] = load_kernel(path)
    result = {"bench": "kv_fp8_decode", "device": device_name(device),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": git_sha(), "torch": torch.__version__, "kernels": [str(k) for k in args.kernel],
              "rounds": args.rounds, "launches": [list(x) for x in launches],
              "min_splits": args.min_split,
              "cases": {label: case(label, *shape, kernels, device, rounds=args.rounds, launches=launches,
                                    min_splits=tuple(args.min_split))
                        for label, *shape in (args.shape or CASES)}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
