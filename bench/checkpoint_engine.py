"""Weight-sync bandwidth of lathe.workers.checkpoint_engine: the trainer's rank 0 broadcasting a model's weights.

    python bench/checkpoint_engine.py [--models 1.5b,7b] [--buckets-mb 256,512,1024] [--repeats 3] [--warmup 1]
        [--git-sha SHA] [--out bench/results/checkpoint_engine_<device>.json]
    python bench/checkpoint_engine.py --device cpu --models tiny --buckets-mb 1,4 --out /tmp/ce_smoke.json  # CPU smoke

One process per GPU: rank 0 (cuda:0) is the sender, as the trainer's rank 0 is; ranks 1..N-1 (one per other GPU)
are receivers, as the rollout replicas are; each builds the `SyncGroup` (NCCL) without any default process group.
The weights are random bf16 tensors with the parameter shapes of a Qwen2.5 model (bench/train.py's SHAPES: q/k/v
with biases, o, gate/up/down, two norms a layer, the final norm, the embedding, and lm_head when untied). Per
model and bucket size: `--warmup` untimed syncs, then `--repeats` timed ones, each after a barrier; a sync's time
is the slowest rank's (`send_weights`/`receive_weights` seconds: packing, broadcasting and, on the receivers,
copying every bucket into their own copy of the model, until the device is idle). Reported: the median over
repeats as seconds, GB/s (payload bytes / seconds) and ms per GB. After the last sync each receiver's weights are
checked against the sender's by checksum. `--device cpu` runs the same with Gloo (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import socket
import statistics
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from lathe.workers.checkpoint_engine import (SyncGroup, TensorMeta, metas_of, receive_weights,  # noqa: E402
                                             send_weights)


def param_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen2 decoder's parameter names and shapes (transformers' names) from its config."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, vocab = h // heads, cfg["vocab_size"]
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.q_proj.bias", (heads * hd,)),
                   (p + "self_attn.k_proj.weight", (kv * hd, h)), (p + "self_attn.k_proj.bias", (kv * hd,)),
                   (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.v_proj.bias", (kv * hd,)),
                   (p + "self_attn.o_proj.weight", (h, heads * hd)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (vocab, h)))
    return shapes


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two integer sums of the raw bits (all of them, and every 7th element): equal bits give equal sums."""
    bits = t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
    return int(bits.sum(dtype=torch.int64)), int(bits[::7].sum(dtype=torch.int64))


def barrier(group: SyncGroup) -> None:
    group.wait(group.broadcast(torch.zeros(1, device=group.device), src=0))
    group.synchronize()


def bench_one(group: SyncGroup, shapes: list, args) -> dict:
    """This rank's seconds per bucket size (warm-up left out) and, on receivers, the checksums at the end."""
    device, dtype = group.device, torch.bfloat16
    metas = [TensorMeta(name, shape, dtype) for name, shape in shapes]
    gen = torch.Generator(device).manual_seed(0)
    if group.rank == 0:
        weights = {m.name: torch.randn(m.shape, generator=gen, device=device, dtype=dtype) for m in metas}
        assert metas_of(weights.items(), dtype) == metas
    else:
        weights = {m.name: torch.zeros(m.shape, device=device, dtype=dtype) for m in metas}

    def consume(views):
        for name, view in views:
            weights[name].copy_(view)

    seconds = {}
    for mb in args.buckets_mb:
        bucket_bytes = int(mb * (1 << 20))
        times = []
        for _ in range(args.warmup + args.repeats):
            barrier(group)
            if group.rank == 0:
                stats = send_weights(group, iter(weights.items()), metas, bucket_bytes=bucket_bytes)
            else:
                stats = receive_weights(group, metas, bucket_bytes=bucket_bytes, consume=consume)
            times.append(stats["seconds"])
        seconds[str(mb)] = {"seconds": times[args.warmup:], "bytes": stats["bytes"], "buckets": stats["buckets"]}
        del stats
    sums = [checksum(weights[m.name]) for m in metas]
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"by_bucket": seconds, "checksums": sums}


def worker(rank: int, world: int, port: int, models: dict, args, queue) -> None:
    group = None
    try:
        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = SyncGroup("127.0.0.1", port, rank, world, device=device, timeout_s=args.timeout)
        for name, shapes in models.items():
            queue.put((rank, name, bench_one(group, shapes, args)))
        barrier(group)    # rank 0 hosts the store: it stays until everyone is done
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if group is not None:
            group.close()


def summarise(per_rank: dict[int, dict], args) -> dict:
    """Per bucket size: the slowest rank's time per repeat, then the median over repeats."""
    rows = {}
    for mb in map(str, args.buckets_mb):
        slowest = [max(per_rank[r]["by_bucket"][mb]["seconds"][i] for r in per_rank) for i in range(args.repeats)]
        sec = statistics.median(slowest)
        gb = per_rank[0]["by_bucket"][mb]["bytes"] / 1e9
        rows[mb] = {"gb": round(gb, 4), "seconds": sec, "gb_per_s": gb / sec, "ms_per_gb": 1e3 * sec / gb,
                    "buckets": int(per_rank[0]["by_bucket"][mb]["buckets"]), "seconds_per_repeat": slowest}
    sums = per_rank[0]["checksums"]
    bad = [r for r in per_rank if r > 0 and per_rank[r]["checksums"] != sums]
    return {"bucket_mb": rows, "receivers_bit_equal": not bad, "receivers_that_differ": bad}


def print_table(results: dict) -> None:
    print(f"\n{results['device']} x{results['world_size']} ({results['receivers']} receivers), torch {results['torch']}")
    print(f"{'model':<8}{'bucket MB':>10}{'buckets':>9}{'GB':>9}{'seconds':>10}{'GB/s':>9}{'ms/GB':>11}  bit-equal")
    for model, res in results["models"].items():
        for mb, row in res["bucket_mb"].items():
            print(f"{model:<8}{mb:>10}{row['buckets']:>9}{row['gb']:>9.3f}{row['seconds']:>10.4f}"
                  f"{row['gb_per_s']:>9.1f}{row['ms_per_gb']:>11.2f}  {res['receivers_bit_equal']}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1.5b,7b", help="comma list of bench/train.py SHAPES (tiny, 0.5b, 1.5b, 7b)")
    p.add_argument("--buckets-mb", default="256,512,1024", help="bucket sizes in MiB (comma list)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--receivers", type=int, default=None, help="default: every other GPU (cuda), 2 (cpu)")
    p.add_argument("--timeout", type=float, default=300, help="seconds any one wait may take")
    p.add_argument("--git-sha", default=None, help="the commit measured (a copied tree's .git may be stale)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.buckets_mb = [float(x) if "." in x else int(x) for x in args.buckets_mb.split(",")]
    return args


def main() -> int:
    from common import SHAPES, device_name, git_sha, slug   # here, not at the top: the spawned workers skip it
    args = parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"bench/checkpoint_engine.py: needs 2 GPUs or more (1 sender, the rest receivers); this machine "
                 f"shows {torch.cuda.device_count()}. Use --device cpu for a smoke test.")
    receivers = args.receivers or (torch.cuda.device_count() - 1 if args.device == "cuda" else 2)
    world = 1 + receivers
    models = {m: param_shapes(SHAPES[m]) for m in args.models.split(",")}
    name = device_name(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    out = Path(args.out or ROOT / "bench" / "results" / f"checkpoint_engine_{slug(name)}.json")
    results = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "world_size": world, "receivers": receivers, "dtype": "bfloat16", "warmup": args.warmup,
               "repeats": args.repeats, "models": {}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, models, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    status, deadline = 0, args.timeout * (2 + len(args.buckets_mb) * (args.warmup + args.repeats))
    try:
        for model in models:
            per_rank = {}
            while len(per_rank) < world:
                rank, got, result = queue.get(timeout=deadline)
                if got is None:
                    raise RuntimeError(f"rank {rank} failed:\n{result}")
                per_rank[rank] = result
            results["models"][model] = {"params": sum(torch.Size(s).numel() for _, s in models[model]),
                                        **summarise(per_rank, args)}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2))
        print_table(results)
        print(f"\nwrote {out}")
    except BaseException as e:
        print(f"bench/checkpoint_engine.py: {type(e).__name__}: {e}", file=sys.stderr)
        status = 1
    finally:
        for p in procs:
            p.join(timeout=30 if status == 0 else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return status


if __name__ == "__main__":
    sys.exit(main())
