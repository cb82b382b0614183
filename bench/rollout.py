"""Generation throughput of lathe's engine against transformers `generate` and `generate_batch`, on one GPU.

    python bench/rollout.py [--models 0.5b,1.5b,7b] [--loads fixed,grpo] [--hf-models 0.5b,1.5b,7b]
                            [--hf-grpo-models 0.5b] [--out bench/results/rollout_<device>.json]
    python bench/rollout.py --device cpu --models tiny --prompts 4 --grpo-prompts 2 --new-tokens 8   # smoke test
    python bench/rollout.py --models qwen3.5-2b --hf-models qwen3.5-2b --hf-grpo-models "" --loads fixed \
        --baselines generate                  # Qwen3.5 (transformers' generate_batch refuses linear attention)
    python bench/rollout.py --device cpu --models tiny-qwen3.5 --hf-models tiny-qwen3.5 --loads fixed --prompts 4 \
        --new-tokens 8 --baselines generate --out /tmp/x.json                                        # its smoke test
    python bench/rollout.py --models 1.5b,7b --hf-models "" --hf-grpo-models "" --kv-cache-dtype auto,fp8
                              # the FP8 KV cache's A/B: the bf16 cache's rows, then lathe_kv_fp8 beside them

Random-weight shapes of bench/common.py's SHAPES in bf16 (Qwen2.5 by default; any other, e.g. `--models qwen3.5-2b
--hf-models qwen3.5-2b`, also against the baselines), the same weights in every backend (lathe's model is converted
from transformers' by state dict). Three loads (`--loads`, fixed and grpo by default):
- fixed: `--prompts` random prompts of `--prompt-len` tokens, `--new-tokens` forced new tokens each
  (ignore_eos / min_new_tokens), sampling at temperature 1 (no top-k/top-p);
- grpo: `--grpo-prompts` prompts of random lengths in [64, 512], n=`--grpo-n` samples each, responses of
  natural length up to `--grpo-max-tokens` (random weights rarely sample EOS, so most run to the cap);
- grpo_eos: the grpo prompts with responses that end: every `--eos-period`-th token id stops one, so the lengths
  spread roughly geometrically (mean near the period) under `--eos-max-tokens`, as a trained policy's responses
  vary; the case for admission, which must guess lengths well below max_tokens.
Reported: generated tokens/s (wall time of the whole call, prefill included; the second of two identical calls,
each starting with an empty prefix cache as after a weight sync; the first's time and graph-capture seconds beside
it, and a third call's that finds the prompts cached), the prefill and decode steps of each call (counts, host wall
seconds, prefilled tokens), and the fraction of the decode
roofline: per step, the weights' bytes plus the KV bytes of every running sequence's context (a hybrid's attention
layers only) and its linear-attention states (read and written back), over the HBM bandwidth; the roofline rate is
the batch over that time, averaged over the run's decode steps. A mixture-of-experts shape has two:
- `roofline_fraction`: issue 44's definition, the *active* parameters (non-expert weights and top-k experts a
  layer) as a step's weight bytes;
- `roofline_touched_fraction`: the experts a step's rows are expected to touch (E(1 - (1 - k/E)^B) a layer for B
  rows routed at random, `roofline.touched_weight_bytes`): what a step physically reads. At 256 rows x top-8 of 128
  (Qwen3-30B-A3B) that is nearly every expert, ten times the active bytes;
and `roofline_fraction_ceiling` (the touched roofline over the active one): the most `roofline_fraction` can reach
at that batch while every touched expert is read. Random weights route near uniformly; a trained router touches
fewer. For a dense shape the two rooflines are one.
A torch.profiler summary of the engine's decode (eager, same batch) says where the time goes.
Writes JSON after each model, so a timeout keeps what finished.

A component benchmark: the engine alone on a fixed load. `lathe train`'s rollout phase (the engine on the
actor's own bf16 weights, KV cache re-sized at each wake-up) is timed by `bench/e2e.py` (`phases_s.gen`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (SHAPES, batched_tokens, build_hf, datasheet_peak, device_name, git_sha, hbm_bandwidth,  # noqa: E402
                    kv_bytes_per_token, linear_state_bytes, param_count, profile_summary, random_prompts, roofline_tok_s,
                    slug, sync, weight_bytes)
from roofline import decode_weight_bytes, layer_matmul_params  # noqa: E402

from lathe.engine import choices, scheduler  # noqa: E402
from lathe.engine.llm_engine import LatheEngine  # noqa: E402
from lathe.generation import SamplingParams  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402

def prefill_seconds_at_peak(shape: dict, prompt_lens: list[int], peak_flops: float) -> float:
    """The prefill's least time: 2 FLOPs per weight of the decoder layers a token runs through (a MoE shape: its
    active experts) per prompt token (the embedding is a lookup; the lm_head runs on one row per prompt) at the
    device's dense bf16 peak. Attention's own FLOPs are left out, which makes it lower still."""
    return 2 * layer_matmul_params(shape) * sum(prompt_lens) / peak_flops


def roofline_weight_bytes(shape: dict, model) -> int:
    """The weight bytes a decode step reads in the roofline: the model's own (every parameter, embedding included,
    as measured so far for dense shapes); a MoE shape's active parameters (`roofline.decode_weight_bytes`: issue 44
    defines its roofline so)."""
    return decode_weight_bytes(shape) if shape.get("num_experts") else weight_bytes(model)


# -- backends ---------------------------------------------------------------------------------------------
class StepStats:
    """Per-call counts and host wall seconds of the engine's prefill and decode steps (`engine.step` wrapped):
    with overlapped scheduling a step's wall time is the host's, which waits for the device's previous step."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step
        schedule = engine.scheduler.schedule

        def counted_schedule():
            seqs, is_prefill, copies = schedule()
            self.kind = "prefill" if is_prefill else "decode"
            if is_prefill:
                self.stats["prefill_tokens"] += sum(s.num_scheduled_tokens for s in seqs)
            return seqs, is_prefill, copies

        def timed_step():
            self.kind = None
            start = time.perf_counter()
            n = self.step()
            if self.kind is not None:
                self.stats[f"{self.kind}_steps"] += 1
                self.stats[f"{self.kind}_wall_s"] += time.perf_counter() - start
            return n

        engine.scheduler.schedule, engine.step = counted_schedule, timed_step
        self.reset()

    def reset(self) -> dict:
        old, self.stats = getattr(self, "stats", None), dict.fromkeys(
            ("prefill_steps", "prefill_wall_s", "prefill_tokens", "decode_steps", "decode_wall_s"), 0)
        return old


def run_lathe(engine, prompts, params, device) -> dict:
    engine.generate([p[:8] for p in prompts],
                    SamplingParams(n=params.n, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1))  # warm-up
    sync(device)
    stats = StepStats(engine)
    runs = []
    for cold in (True, True, False):    # the first run captures the graphs of batch sizes the warm-up did not meet;
        if cold:                        # the third finds its prompts cached (the second's)
            engine.update_weights([])   # no prompt found in the prefix cache: as after a training step's sync
        stats.reset()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(device)
        runs.append((time.perf_counter() - start, out.metrics, stats.reset()))
    (first, m1, s1), (seconds, m2, s2), (cached, _, s3) = runs
    lens = [len(t) for t in out.token_ids]
    return {"seconds": seconds, "tokens": sum(lens), "tok_s": sum(lens) / seconds, "out_lens": lens,
            "preemptions": m2["rollout/num_preemptions"], "first_run_seconds": first,
            "first_run_graph_capture_s": m1["timing_s/graph_capture"], "graph_capture_s": m2["timing_s/graph_capture"],
            "cached_prompts_seconds": cached, "steps": {"first": s1, "timed": s2, "cached_prompts": s3}}


def run_hf_generate(model, prompts, n, max_new, forced, device) -> dict:
    """transformers `generate`: one left-padded batch of every prompt repeated n times."""
    rows = [p for p in prompts for _ in range(n)]
    L = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(rows):
        ids[r, L - len(p):], mask[r, L - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=0)
    if forced:
        kw["min_new_tokens"] = max_new
    with torch.inference_mode():
        model.generate(input_ids=ids[:, -8:], attention_mask=mask[:, -8:], **{**kw, "max_new_tokens": 2,
                                                                            "min_new_tokens": 0})
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        sync(device)
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - L) * len(rows)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def run_hf_generate_batch(model, prompts, n, max_new, forced, device) -> dict:
    """transformers `generate_batch` (continuous batching, paged attention)."""
    from transformers import GenerationConfig
    rows = [p for p in prompts for _ in range(n)]
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                           eos_token_id=None if forced else 0, pad_token_id=0)
    start = time.perf_counter()      # no inference_mode here: generate_batch's worker thread reuses its tensors
    out = model.generate_batch(inputs=rows, generation_config=cfg, progress_bar=False)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in out.values())
    if tokens == 0:
        raise RuntimeError(f"generate_batch returned no tokens for {len(rows)} requests")
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def _generate_batch_child(name, prompts, n, max_new, forced, device, queue) -> None:
    device = torch.device(device)
    hf = build_hf(name, device, torch.bfloat16).eval()
    try:
        queue.put(run_hf_generate_batch(hf, prompts, n, max_new, forced, device))
    except Exception as e:
        queue.put({"error": f"{type(e).__name__}: {e}"[:400]})


def run_hf_generate_batch_isolated(name, prompts, n, max_new, forced, device, timeout: float) -> dict:
    """`run_hf_generate_batch` in a child process (same seed, same weights) that is killed after `timeout`
    seconds: transformers' continuous batching can run for many minutes on these loads."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_generate_batch_child, args=(name, prompts, n, max_new, forced, str(device), queue))
    start = time.perf_counter()
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return {"error": f"did not finish within {timeout:.0f} s (model build included); killed"}
    result = queue.get() if not queue.empty() else {"error": f"child exited with code {child.exitcode}"}
    result["wall_with_build_s"] = time.perf_counter() - start
    return result


def engine_profile(model, prompts, params, device) -> dict:
    """Device time of a few eager decode steps by category (where a step's time goes)."""
    eager = LatheEngine(model, eos_token_id=None, max_num_seqs=len(prompts) * params.n, enforce_eager=True,
                        gpu_memory_utilization=0.85)
    short = SamplingParams(n=params.n, temperature=1.0, max_tokens=6, ignore_eos=True, seed=0)
    summary = profile_summary(lambda: eager.generate(prompts, short), device)
    eager.sleep()
    return summary


# -- one model --------------------------------------------------------------------------------------------
def bench_model(name: str, device, args) -> dict:
    shape = SHAPES[name]
    hf = build_hf(name, device, torch.bfloat16).eval()
    # a model whose bf16 weights take over a third of the device (the full Qwen3.5-35B-A3B: 70 GB) has one copy:
    # lathe's decoder shares the transformers model's tensors, which then stays on the device (the host could not
    # hold it either)
    shared = (device.type == "cuda"
              and 2 * param_count(shape) > torch.cuda.get_device_properties(device).total_memory / 3)
    lathe = lathe_from_transformers(hf, clone=not shared).eval()
    # the transformers copy is only the baselines' model: on the device it would take the KV cache's room (a 7B
    # copy is 15 GB, half of what gpu_memory_utilization=0.5 leaves the cache), so it waits on the host meanwhile
    baselines = name in args.hf_models or name in args.hf_grpo_models
    hf = (hf if shared else hf.to("cpu")) if baselines else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bandwidth = hbm_bandwidth(device_name(device)) if device.type == "cuda" else None
    wbytes = roofline_weight_bytes(shape, lathe)
    result = {"shape": shape, "weight_bytes": weight_bytes(lathe), "one_shared_copy": shared, "roofline_weight_bytes": wbytes,
              "kv_bytes_per_token": kv_bytes_per_token(shape), "linear_state_bytes_per_seq": linear_state_bytes(shape),
              "loads": {}}
    grpo_prompts = random_prompts(args.grpo_prompts, min(64, args.prompt_len), max(64, 2 * args.prompt_len),
                                  shape["vocab_size"], 1)
    loads = {
        "fixed": (random_prompts(args.prompts, args.prompt_len, args.prompt_len, shape["vocab_size"], 0),
                  SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0), True),
        "grpo": (grpo_prompts,
                 SamplingParams(n=args.grpo_n, temperature=1.0, max_tokens=args.grpo_max_tokens, seed=0), False),
        # the grpo prompts with responses that end: every `--eos-period`-th token id stops a sequence, so lengths
        # spread roughly geometrically (mean about the period) under `--eos-max-tokens`, as a trained policy's do
        "grpo_eos": (grpo_prompts,
                     SamplingParams(n=args.grpo_n, temperature=1.0, max_tokens=args.eos_max_tokens, seed=0,
                                    stop_token_ids=list(range(0, shape["vocab_size"], args.eos_period))), False),
    }
    loads = {load: (prompts, dataclasses.replace(params, top_k=args.top_k, top_p=args.top_p), forced)
             for load, (prompts, params, forced) in loads.items()}
    max_seqs = max(args.prompts, args.grpo_prompts * args.grpo_n)
    if args.overcommit is not None:      # an A/B of the admission rule (1 = reserve for every response in full)
        scheduler.OVERCOMMIT = args.overcommit

    def new_engine(model, quantization=None, kv_cache_dtype=args.kv_cache_dtype[0], quantize_lm_head=False):
        made = LatheEngine(model, eos_token_id=shape["vocab_size"] - 1, max_num_seqs=max_seqs,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           reserve_new_tokens=not args.no_reserve, async_scheduling=not args.step_by_step,
                           quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                           quantize_lm_head=quantize_lm_head, **batched_tokens(args))
        made.fork_samples = made.fork_samples and not args.no_fork
        return made
    if args.compile_mode and device.type == "cuda":   # issue 48's A/B: the layers compiled in another inductor mode
        from lathe.models.compile import compile_decoder
        compile_decoder(lathe, mode=args.compile_mode)   # (the engine's own compile_decoder call is then a no-op)
    engine = new_engine(lathe)
    result["engine"] = {"max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                        "compile_mode": args.compile_mode if device.type == "cuda" else None,
                        "reserve_new_tokens": not args.no_reserve, "overcommit": scheduler.OVERCOMMIT,
                        "fork_samples": engine.fork_samples,
                        "async_scheduling": not args.step_by_step, "kv_blocks": engine.kv_cache.num_blocks,
                        "block_size": engine.kv_cache.block_size, "kv_cache_dtype": args.kv_cache_dtype[0],
                        "kv_cache_gb": engine.kv_cache.nbytes / 2**30,
                        "decode_backend": engine.runner.decode_backend,
                        "decode_backend_probe_ms": engine.runner.backend_times,
                        "moe_backend": engine.runner.moe_backend,
                        "moe_backend_probe_ms": engine.runner.moe_times,
                        # (one entry per probe when the choice was remembered: `lathe.engine.choices`)
                        "choices_remembered_in": str(choices.path()) if choices.path().exists() else None,
                        "cuda_graphs": engine.runner.graphs is not None}
    for load in args.loads:
        prompts, params, forced = loads[load]
        row = {"prompts": len(prompts), "n": params.n, "max_tokens": params.max_tokens, "forced": forced}
        row["lathe"] = run_lathe(engine, prompts, params, device)
        out_lens = row["lathe"].pop("out_lens")
        if bandwidth:
            prompt_lens = [len(p) for p in prompts for _ in range(params.n)]
            roof = roofline_tok_s(shape, wbytes, prompt_lens, out_lens, bandwidth)
            touched = roofline_tok_s(shape, wbytes, prompt_lens, out_lens, bandwidth, touched=True)
            row.update(roofline_tok_s=roof, roofline_touched_tok_s=touched, roofline_fraction_ceiling=touched / roof)
            row["lathe"]["roofline_fraction"] = row["lathe"]["tok_s"] / roof
            row["lathe"]["roofline_touched_fraction"] = row["lathe"]["tok_s"] / touched
            peak = (datasheet_peak(device_name(device)) or 0) * 1e12 or None
            if peak:   # the decode roofline leaves the prefill out; with it at the compute peak (prompts once each)
                least = row["lathe"]["tokens"] / roof + prefill_seconds_at_peak(shape, [len(p) for p in prompts], peak)
                row["roofline_with_prefill_tok_s"] = row["lathe"]["tokens"] / least
                row["lathe"]["roofline_with_prefill_fraction"] = row["lathe"]["tok_s"] * least / row["lathe"]["tokens"]
        hf_models = args.hf_models if load == "fixed" else args.hf_grpo_models
        if name in hf_models:
            engine.sleep()                      # the KV cache's memory goes to the baselines meanwhile
            if not shared:
                hf.to(device)
            for base in ("hf_generate", "hf_generate_batch"):
                if base.removeprefix("hf_") not in args.baselines:
                    continue
                try:
                    if base == "hf_generate":
                        row[base] = run_hf_generate(hf, prompts, params.n, params.max_tokens, forced, device)
                    else:
                        row[base] = run_hf_generate_batch_isolated(name, prompts, params.n, params.max_tokens,
                                                                   forced, device, args.hf_batch_timeout)
                        if "error" in row[base]:
                            continue
                    row[f"speedup_vs_{base}"] = row["lathe"]["tok_s"] / row[base]["tok_s"]
                except Exception as e:            # a baseline that fails is reported, not fatal
                    row[base] = {"error": f"{type(e).__name__}: {e}"[:400]}
                    traceback.print_exc()
            if not shared:
                hf.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            engine.wake_up()
        result["loads"][load] = row
        if args.partial_out:
            args.partial_out(result)
        print(f"{name} {load}: " + ", ".join(f"{k} {v['tok_s']:.0f} tok/s" for k, v in row.items()
                                             if isinstance(v, dict) and "tok_s" in v), flush=True)
    if args.profile and device.type == "cuda":
        prompts, params, _ = loads["fixed"]
        engine.sleep()
        result["profile_eager_decode"] = engine_profile(lathe, prompts, params, device)
    engine.sleep()

    def arm(engine, key: str, against: str) -> None:
        """Each load on `engine` as `lathe_<key>` beside the first engine's row, its speed-up as `<key>_speedup`."""
        for load in args.loads:
            prompts, params, _ = loads[load]
            row = result["loads"][load]
            row[f"lathe_{key}"] = run_lathe(engine, prompts, params, device)
            row[f"lathe_{key}"].pop("out_lens")
            row[f"{key}_speedup"] = row[f"lathe_{key}"]["tok_s"] / row["lathe"]["tok_s"]
            print(f"{name} {load}: {key} {row[f'lathe_{key}']['tok_s']:.0f} tok/s, {row[f'{key}_speedup']:.2f}x "
                  f"{against}", flush=True)
            if args.partial_out:
                args.partial_out(result)
        engine.sleep()

    for kv_dtype in args.kv_cache_dtype[1:]:    # the same model and loads with another KV cache (issue 48's A/B)
        del engine
        torch.cuda.empty_cache() if device.type == "cuda" else None
        engine = new_engine(lathe, kv_cache_dtype=kv_dtype)
        result[f"engine_kv_{kv_dtype}"] = {"kv_blocks": engine.kv_cache.num_blocks,
                                           "kv_cache_gb": engine.kv_cache.nbytes / 2**30,
                                           "decode_backend": engine.runner.decode_backend,
                                           "decode_backend_probe_ms": engine.runner.backend_times}
        arm(engine, f"kv_{kv_dtype}", f"kv_cache_dtype={args.kv_cache_dtype[0]}")
    # the same shape and loads with FP8 projections (fp8_lm_head: and the lm_head), after the bf16 rows
    for scheme in [q for q in ("fp8", "fp8_lm_head") if q in args.quantizations]:
        del engine, lathe                 # (a model of its own, random like the first, as `lathe train` builds one)
        torch.cuda.empty_cache() if device.type == "cuda" else None
        lathe = lathe_from_transformers(build_hf(name, device, torch.bfloat16)).eval()
        for i, kv_dtype in enumerate(args.kv_cache_dtype):   # FP8 projections, then with each other KV cache too
            suffix = "" if i == 0 else f"_kv_{kv_dtype}"
            if i:
                del engine
                torch.cuda.empty_cache() if device.type == "cuda" else None
            engine = new_engine(lathe, "fp8", kv_cache_dtype=kv_dtype, quantize_lm_head=scheme == "fp8_lm_head")
            result[f"engine_{scheme}{suffix}"] = {"kv_blocks": engine.kv_cache.num_blocks}
            arm(engine, f"{scheme}{suffix}", "bf16")
    del engine, lathe, hf
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return result


def goals(results: dict) -> dict:
    fixed = results.get("models", {}).get("0.5b", {}).get("loads", {}).get("fixed", {})
    speed = fixed.get("speedup_vs_hf_generate")
    fixed_rows = {m: r["loads"]["fixed"] for m, r in results.get("models", {}).items() if "fixed" in r.get("loads", {})}
    roofs = {m: row["lathe"].get("roofline_fraction") for m, row in fixed_rows.items()}
    return {"speedup_0.5b_batch256_vs_generate": speed, "goal_15x_met": speed is not None and speed >= 15,
            "speedup_vs_generate_fixed": {m: row["speedup_vs_hf_generate"] for m, row in fixed_rows.items()
                                          if "speedup_vs_hf_generate" in row},
            "roofline_fraction_fixed": roofs,
            "roofline_touched_fraction_fixed": {m: row["lathe"].get("roofline_touched_fraction")
                                                for m, row in fixed_rows.items()},
            "goal_40pct_roofline_met": {m: f is not None and f >= 0.4 for m, f in roofs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda s: [x for x in s.split(",") if x]   # noqa: E731
    ap.add_argument("--models", type=csv, default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--loads", type=csv, default=["fixed", "grpo"])
    ap.add_argument("--baselines", type=csv, default=["generate", "generate_batch"])
    ap.add_argument("--hf-models", type=csv, default=["0.5b", "1.5b", "7b"], help="models with HF baselines (fixed)")
    ap.add_argument("--hf-grpo-models", type=csv, default=["0.5b"], help="models with HF baselines (grpo)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-n", type=int, default=8)
    ap.add_argument("--grpo-max-tokens", type=int, default=1024)
    ap.add_argument("--eos-period", type=int, default=512, help="grpo_eos: every n-th token id ends a response")
    ap.add_argument("--eos-max-tokens", type=int, default=4096, help="grpo_eos: the responses' max_tokens")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the engine's prefill step budget (default: the engine's, 16384)")
    ap.add_argument("--hf-batch-timeout", type=float, default=240.0,
                    help="seconds before a generate_batch baseline (run in a child process) is killed")
    ap.add_argument("--no-fork", action="store_true",
                    help="hybrid models: every sample prefills its own prompt (the A/B of the engine's forks)")
    ap.add_argument("--no-reserve", action="store_true",
                    help="admit whatever prompt fits (no KV room reserved for the responses still to come)")
    ap.add_argument("--overcommit", type=float, default=None,
                    help="admit a call's whole load when it fits with responses at 1/this of max_tokens "
                         "(default: the scheduler's OVERCOMMIT; 1 reserves for every response in full)")
    ap.add_argument("--top-k", type=int, default=-1,
                    help="every load samples with this top-k (-1: off; lathe only, not the HF baselines)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every load samples with this top-p (1: off; lathe only)")
    ap.add_argument("--step-by-step", action="store_true",
                    help="resolve each step's tokens before scheduling the next (no overlap of host and device)")
    ap.add_argument("--profile", action="store_true", help="add an eager decode profile per model")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode of the engine's decoder layers (default: inductor's default; e.g. "
                         "max-autotune-no-cudagraphs, under lathe's own CUDA graphs)")
    ap.add_argument("--quantizations", type=csv, default=["none"],
                    help="none,fp8,fp8_lm_head: after the bf16 rows, the same loads with rollout.quantization=fp8 "
                         "(lathe_fp8, fp8_speedup; its KV cache gets what the FP8 copies leave), and with the "
                         "lm_head in FP8 too (rollout.quantize_lm_head: lathe_fp8_lm_head, fp8_lm_head_speedup)")
    ap.add_argument("--fp8-gemm", choices=["unit-fast", "rowwise", "rowwise-fast", "unit"], default="unit-fast",
                    help="the FP8 rows' GEMM form (lathe.engine.fp8: unit scales or the scales inside cuBLAS's "
                         "row-wise kernel; fast accumulation or not); default: lathe's own")
    ap.add_argument("--fp8-copies", choices=["fused", "separate"], default=None,
                    help="the FP8 rows' q/k/v and gate/up copies: one tensor (and GEMM) a group, or one a projection "
                         "(lathe.engine.fp8.FUSE_COPIES); default: lathe's own")
    ap.add_argument("--fp8-swiglu", choices=["triton", "spans", "compiled"], default=None,
                    help="the FP8 rows' gate/up dequantisation, SwiGLU and down-projection quantisation: "
                         "lathe.engine.fp8's Triton kernel (FUSED_SWIGLU; triton: one pass a row, spans: two "
                         "launches) or torch ops inductor fuses in the compiled layer; default: lathe's own")
    ap.add_argument("--kv-cache-dtype", type=csv, default=["auto"],
                    help="the engine's KV cache (auto: bf16; fp8: e4m3 with a scale per token and KV head), recorded "
                         "in the engine block; more than one (auto,fp8): the rows with the first, then the same loads "
                         "with each other (lathe_kv_fp8, kv_fp8_speedup; engine_kv_fp8: its blocks and GB)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--git-sha", default=None, help="the tree's sha where .git is stale (the device copy)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from lathe.engine import fp8
    fp8.ROWWISE_GEMM, fp8.FAST_ACCUM = args.fp8_gemm.startswith("rowwise"), args.fp8_gemm.endswith("fast")
    if args.fp8_copies is not None:
        fp8.FUSE_COPIES = args.fp8_copies == "fused"
    if args.fp8_swiglu is not None:
        fp8.FUSED_SWIGLU, fp8.ONE_PASS = args.fp8_swiglu != "compiled", args.fp8_swiglu == "triton"
    device = torch.device(args.device)
    name = device_name(device)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"rollout_{slug(name)}.json"
    results = {"bench": "rollout", "device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "args": dict(vars(args)), "models": {}}
    def save_partial(model):
        def write(result):
            results["models"][model] = result
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2))
        return write

    for model in args.models:
        args.partial_out = save_partial(model)
        try:
            results["models"][model] = bench_model(model, device, args)
        except Exception as e:
            traceback.print_exc()
            results["models"][model] = {"error": f"{type(e).__name__}: {e}"[:400]}
        results["goals"] = goals(results)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["goals"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
