"""Decode attention over prompts shared by a group's samples: the engine's Triton kernel with and without the
shared-prefix launch (`triton_decode.paged_decode(prefix=...)`), against the bytes each must read.

    python bench/decode_shared_prefix.py [--shapes 0.5b,1.5b,7b] [--rows 256] [--n 8] [--out FILE]

For each model shape's attention (its query and KV heads, head dim; one layer's cache) and each load (prompt length,
new tokens so far), a CUDA graph of `--layers` back-to-back launches (as a decode step's layers run) replayed, three
ways: `distinct` (every row its own prompt blocks: what a batch of different prompts reads), `shared` (the `n` samples
of a prompt on one copy of its blocks, as the block manager shares them: today's kernel, each row reads the prompt on
its own) and `prefix` (shared, with the prefix launch: each prompt's K/V tile read once for its group) at several
prefix splits. Each with the step's new token (RoPE, store and attention in one launch, as the engine calls it).
Reports microseconds per layer and the bandwidth over the bytes each must read (the prompt counted once per row for
`distinct`/`shared`, once per group for `prefix`). Writes JSON (device, date, git sha) to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import device_name, git_sha, graph_seconds, hbm_bandwidth  # noqa: E402

from lathe.engine import triton_decode as td  # noqa: E402

HEADS = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128), "32b": (40, 8, 128)}
PAGE = 16


def tables_for(rows: int, n: int, prompt: int, ctx: int, shared: bool, gen: torch.Generator) -> torch.Tensor:
    """Block tables: each row's prompt blocks (one copy per group of n when shared), then its own blocks."""
    width = -(-ctx // PAGE)
    prompt_blocks = prompt // PAGE                       # full prompt blocks: shared (the partial one is copied)
    groups = rows // n
    own = width - prompt_blocks if shared else width
    total = (groups * prompt_blocks if shared else 0) + rows * own
    ids = torch.randperm(total, generator=gen).int()
    tables = torch.empty(rows, width, dtype=torch.int32)
    at = 0
    if shared:
        for grp in range(groups):
            tables[grp * n:(grp + 1) * n, :prompt_blocks] = ids[at:at + prompt_blocks]
            at += prompt_blocks
    for r in range(rows):
        lo = prompt_blocks if shared else 0
        tables[r, lo:] = ids[at:at + own]
        at += own
    return tables, total


def time_graph(fn, layers: int) -> float:
    """Microseconds per launch of `fn` captured `layers` times in one CUDA graph."""
    return graph_seconds(fn, captured=layers) * 1e6 / layers


def run_case(shape: str, rows: int, n: int, prompt: int, new: int, layers: int, prefix_splits: list[int],
             max_rows: int, bw: float) -> dict:
    hq, hkv, dim = HEADS[shape]
    ctx = prompt + new
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    splits = td.choose_num_splits(rows, hkv, sms)
    per_token = 2 * hkv * dim * 2
    out = {"shape": shape, "rows": rows, "n": n, "prompt": prompt, "new_tokens": new, "context": ctx,
           "num_splits": splits}
    q = torch.randn(rows, hq, dim, device=dev, dtype=torch.bfloat16)
    k_new = torch.randn(rows, hkv, dim, device=dev, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    ang = torch.randn(rows, dim // 2, device=dev)
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
    counters = torch.zeros(rows * hkv, dtype=torch.int32, device=dev)
    for kind in ("distinct", "shared"):
        tables, total = tables_for(rows, n, prompt, ctx, kind == "shared", gen)
        kc = torch.randn(total + 1, PAGE, hkv, dim, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        t_dev = tables.to(dev)
        pos = lens.long() - 1
        slots = t_dev.long().gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
        new_kv = (k_new, v_new, cos, sin, slots)

        def plain():
            return td.paged_decode(q, kc, vc, t_dev, lens, num_splits=splits, counters=counters, new_kv=new_kv)
        us = time_graph(plain, layers)
        read = rows * ctx * per_token
        out[kind] = {"us_per_layer": us, "bytes_read": read, "gb_per_s_over_bytes_read": read / us / 1e3,
                     "bytes_unique": (rows // n * (prompt // PAGE * PAGE) + rows * (ctx - prompt // PAGE * PAGE))
                     * per_token if kind == "shared" else read}
        if kind != "shared":
            continue
        ref = plain().float()
        groups, plens = td.shared_prefixes(tables.numpy(), lens.cpu().numpy(), PAGE, max_rows=max_rows,
                                           min_tokens=64, capacity=rows // 2)
        out["groups"] = sum(1 for g in groups if g[1])
        out["rule_splits"] = td.prefix_splits(groups, hkv, dim, sms)      # what the engine's graphs would take
        for ps in prefix_splits:
            pre = td.SharedPrefix(torch.tensor(groups, dtype=torch.int32, device=dev),
                                  torch.tensor(plens, dtype=torch.int32, device=dev), ps, max_rows)

            def shared():
                return td.paged_decode(q, kc, vc, t_dev, lens, num_splits=splits, counters=counters, new_kv=new_kv,
                                       prefix=pre)
            got = shared().float()
            us = time_graph(shared, layers)
            uniq = out["shared"]["bytes_unique"]
            out[f"prefix_{ps}"] = {"us_per_layer": us, "gb_per_s_over_bytes_unique": uniq / us / 1e3,
                                   "rel_err_vs_plain": float((got - ref).norm() / ref.norm())}
    best = min((k for k in out if k.startswith("prefix_")), key=lambda k: out[k]["us_per_layer"], default=None)
    if best:
        out["best_prefix"] = best
        out["speedup_vs_shared"] = out["shared"]["us_per_layer"] / out[best]["us_per_layer"]
    out["hbm_light_us_shared_unique"] = out["shared"]["bytes_unique"] / bw * 1e6
    out["hbm_light_us_per_row"] = out["shared"]["bytes_read"] / bw * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.5b,1.5b,7b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--loads", default="256:1,256:256,256:511,512:1,512:256,768:256,1024:256,2048:512",
                    help="prompt:new_tokens pairs")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--prefix-splits", default="1,2,4,8")
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = hbm_bandwidth(device_name(dev))
    results = []
    for shape in args.shapes.split(","):
        for load in args.loads.split(","):
            prompt, new = (int(x) for x in load.split(":"))
            r = run_case(shape, args.rows, args.n, prompt, new, args.layers,
                         [int(x) for x in args.prefix_splits.split(",")], args.max_rows, bw)
            results.append(r)
            print(json.dumps({k: (round(v["us_per_layer"], 2) if isinstance(v, dict) else v) for k, v in r.items()}),
                  flush=True)
    doc = {"what": "bench/decode_shared_prefix.py: paged decode attention with the n samples' prompt blocks shared, "
                   "with and without the shared-prefix launch", "device": device_name(dev),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "hbm_bytes_per_s": bw, "page": PAGE, "results": results}
    del dev
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
