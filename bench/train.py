"""Training throughput of lathe's decoder against transformers' own model, on one GPU.

    python bench/train.py [--models 0.5b,1.5b,7b] [--tokens 16384] [--out bench/results/train_<device>.json]
    python bench/train.py --device cpu --models tiny --tokens 512 --min-len 16 --max-len 128 --no-profile \
        --force-compile --out /tmp/train_smoke.json                                        # CPU smoke test

Random-weight Qwen2.5 shapes in bf16. One training step = forward + backward of a next-token
log-likelihood loss over `--tokens` tokens made of sequences of random lengths in [min-len, max-len]:
- lathe (row `lathe_packed`): the trainer's own path. Each sequence is a rollout sample (a 1-token prompt,
  the rest its response) in the rollout's padded layout (`lathe.rollout.base.to_batch`); the model is
  compiled by `lathe.models.compile.maybe_compile`, exactly as `PPOActor` does with verl's default
  `actor.use_torch_compile=true` (on CUDA: each decoder layer and the chunked log-prob math), and the
  loss comes from `lathe.train.logprob.response_log_probs(..., remove_padding=True, calculate_entropy=True)`
  (packed forward with varlen attention, chunked log-probs + entropy), as `PPOActor` computes it with
  `use_remove_padding=true`. Row `lathe_packed_eager`: the same with `use_torch_compile=false`;
- transformers (what TRL does): the same sequences in micro-batches of `--hf-micro-batch` rows, right-padded,
  `model(input_ids, attention_mask, labels)` (SDPA attention, full logits); and once more with one
  sequence per micro-batch (no padding at all), transformers' best case without packing.
Both models hold the same weights (lathe's is converted from transformers' by state dict). 7B runs with
gradient checkpointing on both sides (its activations do not fit otherwise). No optimizer step is timed.

The compiled row also reports `first_step_s` (compilation included). Reported per model: tokens/s (real tokens,
median of timed steps), MFU (model FLOPs: 6 x linear params +
causal attention, over the datasheet bf16 peak and over a measured bf16 matmul rate), peak memory; the
log-prob step (no grad, log-probs + entropy) peak memory with chunked vs full logits; and a torch.profiler
summary of one step of each implementation. Writes JSON after each model, so a timeout keeps what finished.

A component benchmark: the decoder's forward + backward only, on bf16 weights, no optimizer, no rollout. What
`lathe train` achieves (bf16 compute on fp32 master weights, optimizer step included) is `bench/e2e.py`'s
`update_mfu`; quote that figure for the trainer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (SHAPES, build_hf, datasheet_peak, device_name, git_sha, profile_summary, slug, sync,  # noqa: E402
                    train_flops)
from lathe.generation import RolloutOutput  # noqa: E402
from lathe.models.compile import compile_decoder, maybe_compile  # noqa: E402
from lathe.models.hf import lathe_from_transformers  # noqa: E402
from lathe.models.logprob import chunked_log_probs, naive_log_probs  # noqa: E402
from lathe.models.packing import pack_sequences  # noqa: E402
from lathe.rollout.base import to_batch  # noqa: E402
from lathe.train.logprob import response_log_probs  # noqa: E402

CHECKPOINTED = {"7b"}
def median_time(fn, device, *, warmup: int, iters: int) -> float:
    """Median wall seconds of `fn()` (device synchronised around each call), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured_matmul_tflops(device, dtype) -> float | None:
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    seconds = median_time(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n ** 3 / seconds / 1e12


# -- workload ---------------------------------------------------------------------------------------------
def draw_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Random lengths in [lo, hi] adding up to exactly `total` (the last one trimmed, at least lo)."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    excess = sum(lengths) - total
    if lengths[-1] - excess >= lo:
        lengths[-1] -= excess
    else:
        lengths.pop()
    return lengths


def make_sequences(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def trainer_batch(seqs, device):
    """The trainer's input: each sequence as a rollout sample whose prompt is its first token and whose response
    is the rest (so every token but the last is predicted, as in the transformers rows), padded by `to_batch`."""
    responses = [s[1:].tolist() for s in seqs]
    out = RolloutOutput(responses, [[0.0] * len(r) for r in responses], ["length"] * len(seqs))
    return to_batch([[int(s[0])] for s in seqs], out, pad_id=0, n=1).to(device)


def packed_inputs(seqs, device):
    """The log-prob memory probe's inputs: the packed stream, the rows that have a next token and that token."""
    ids, pos, cu, max_len = pack_sequences([s.to(device) for s in seqs])
    ends = cu[1:].long() - 1
    keep = torch.ones(len(ids), dtype=torch.bool, device=device)
    keep[ends] = False
    rows = keep.nonzero(as_tuple=True)[0]
    return dict(ids=ids, pos=pos, cu=cu, max_len=max_len, rows=rows, targets=ids[rows + 1])


def padded_micro_batches(seqs, micro: int, device):
    """transformers' inputs: right-padded micro-batches with labels -100 on padding (HF shifts them itself)."""
    out = []
    for i in range(0, len(seqs), micro):
        group = seqs[i:i + micro]
        L = max(len(s) for s in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        mask = torch.zeros(len(group), L, dtype=torch.long)
        for r, s in enumerate(group):
            ids[r, :len(s)], mask[r, :len(s)] = s, 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids.to(device), mask.to(device), labels.to(device), sum(len(s) - 1 for s in group)))
    return out


# -- models -----------------------------------------------------------------------------------------------
def lathe_train_step(model, batch) -> torch.Tensor:
    """One micro-batch as `PPOActor` runs it with use_remove_padding=true: `response_log_probs` (packed forward,
    chunked log-probs + entropy; compiled with the model), a token-mean loss, backward. The entropy is computed
    and left out of the loss, as with verl's default entropy_coeff=0."""
    model.zero_grad(set_to_none=True)
    logp, _ = response_log_probs(model, batch, calculate_entropy=True, remove_padding=True)
    mask = batch["response_mask"]
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()


def hf_train_step(model, micro_batches) -> torch.Tensor:
    """Token-weighted mean loss over micro-batches (each micro-batch's loss is its own token mean)."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for ids, mask, labels, n in micro_batches:
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        total, count = total + out.loss.detach() * n, count + n
    return total / count


@torch.no_grad()
def lathe_logprob_step(model, inp, chunked: bool):
    hidden = model.forward_packed(inp["ids"], inp["pos"], inp["cu"], inp["max_len"])
    fn = chunked_log_probs if chunked else naive_log_probs
    return fn(hidden[inp["rows"]], model.lm_head.weight, inp["targets"], calculate_entropy=True)


# -- measurement ------------------------------------------------------------------------------------------
def measure_train(step, device, flops, tokens, peaks, args) -> dict:
    """tokens/s, MFU and peak memory of `step()`; the loss of the last call."""
    losses = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds = median_time(lambda: losses.append(step()), device, warmup=args.warmup, iters=args.iters)
    out = {"step_s": seconds, "tokens_per_s": tokens / seconds, "model_tflops_per_s": flops / seconds / 1e12,
           "loss": float(losses[-1])}
    for key, peak in peaks.items():
        if peak:
            out[f"mfu_vs_{key}"] = flops / seconds / 1e12 / peak
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return out


def measure_logprob(model, inp, device, args) -> dict:
    out = {}
    for name, chunked in (("chunked", True), ("full_logits", False)):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        seconds = median_time(lambda: lathe_logprob_step(model, inp, chunked), device, warmup=1, iters=3)
        row = {"step_s": seconds}
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            row.update(peak_memory_gib=peak / 2 ** 30, peak_above_weights_gib=(peak - base) / 2 ** 30)
        out[name] = row
    if device.type == "cuda":
        out["peak_ratio_full_over_chunked"] = out["full_logits"]["peak_memory_gib"] / out["chunked"]["peak_memory_gib"]
        out["extra_ratio_full_over_chunked"] = (out["full_logits"]["peak_above_weights_gib"]
                                                / out["chunked"]["peak_above_weights_gib"])
    return out


def head_time(model, inp, device, args) -> float:
    """Seconds of the loss head alone: chunked log-probs over the packed hidden states, forward + backward."""
    hidden = torch.randn(len(inp["rows"]), model.config.hidden_size, device=device, dtype=model.dtype,
                         requires_grad=True)

    def step():
        logp, _ = chunked_log_probs(hidden, model.lm_head.weight, inp["targets"], compile_backend=model.compile_backend)
        (-logp.mean()).backward()
        hidden.grad = None
        model.zero_grad(set_to_none=True)
    return median_time(step, device, warmup=args.warmup, iters=args.iters)


def measure_lathe(model, batch, device, flops, tokens, peaks, args) -> dict:
    """The trainer's step: compile as `PPOActor` does (`maybe_compile`, or always with --force-compile), time the
    first step (compilation included), then tokens/s and MFU as for every row."""
    start = time.perf_counter()
    if args.force_compile:
        compile_decoder(model)
    compiled = maybe_compile(model, args.use_torch_compile)
    lathe_train_step(model, batch)
    sync(device)
    first_step_s = time.perf_counter() - start
    row = measure_train(lambda: lathe_train_step(model, batch), device, flops, tokens, peaks, args)
    row.update(use_torch_compile=compiled, first_step_s=first_step_s)
    return row


def bench_model(shape_name: str, device, dtype, peaks, args) -> dict:
    shape = SHAPES[shape_name]
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    seqs = make_sequences(lengths, shape["vocab_size"], args.seed)
    tokens, flops = sum(lengths), train_flops(shape, lengths)
    ckpt = shape_name in CHECKPOINTED
    res = {"shape": shape, "tokens_per_step": tokens, "num_sequences": len(lengths), "lengths": lengths,
           "gradient_checkpointing": ckpt, "model_flops_per_step": flops}
    hf = build_hf(shape_name, device, dtype)
    res["parameters"] = sum(p.numel() for p in hf.parameters())
    if ckpt:
        hf.gradient_checkpointing_enable()
    for key, micro in (("transformers_padded", args.hf_micro_batch), ("transformers_unpadded_mb1", 1)):
        if key.endswith("mb1") and (ckpt or args.skip_mb1):
            continue
        mbs = padded_micro_batches(seqs, micro, device)
        padded = sum(mb[0].numel() for mb in mbs)
        try:
            row = measure_train(lambda: hf_train_step(hf, mbs), device, flops, tokens, peaks, args)
            row.update(micro_batch=micro, padded_tokens=padded, padding_efficiency=tokens / padded)
            if key == "transformers_padded" and args.profile and not ckpt:
                row["profile"] = profile_summary(lambda: hf_train_step(hf, mbs), device)
        except torch.OutOfMemoryError as e:
            row = {"error": f"out of memory: {str(e).splitlines()[0]}", "micro_batch": micro}
        res[key] = row
        hf.zero_grad(set_to_none=True)
        print(f"  {shape_name} {key}: {_fmt(row)}", flush=True)
    lathe = lathe_from_transformers(hf).train()
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if ckpt:
        lathe.gradient_checkpointing_enable()
    batch, inp = trainer_batch(seqs, device), packed_inputs(seqs, device)
    res["attention_backend"] = lathe.packed_backend()
    if args.eager:   # before compiling: compilation is in place, per instance
        res["lathe_packed_eager"] = measure_train(lambda: lathe_train_step(lathe, batch), device, flops, tokens,
                                                  peaks, args)
        print(f"  {shape_name} lathe_packed_eager: {_fmt(res['lathe_packed_eager'])}", flush=True)
    lathe.zero_grad(set_to_none=True)
    lathe.eval()
    res["logprob_step"] = measure_logprob(lathe, inp, device, args)
    print(f"  {shape_name} logprob_step: {res['logprob_step']}", flush=True)
    lathe.train()
    try:
        row = measure_lathe(lathe, batch, device, flops, tokens, peaks, args)
        if args.profile and not ckpt:
            row["profile"] = profile_summary(lambda: lathe_train_step(lathe, batch), device)
        row["head_fwd_bwd_s"] = head_time(lathe, inp, device, args)
    except Exception as e:   # e.g. a compile failure: keep the other rows, say what broke
        traceback.print_exc()
        row = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()[:500]}
    res["lathe_packed"] = row
    print(f"  {shape_name} lathe_packed: {_fmt(row)}", flush=True)
    base = res.get("transformers_padded", {})
    if "tokens_per_s" in row and "tokens_per_s" in base:
        res["speedup_vs_transformers_padded"] = row["tokens_per_s"] / base["tokens_per_s"]
        res["loss_rel_diff_lathe_vs_transformers"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
    if "tokens_per_s" in row and "tokens_per_s" in res.get("transformers_unpadded_mb1", {}):
        res["speedup_vs_transformers_unpadded_mb1"] = row["tokens_per_s"] / res["transformers_unpadded_mb1"]["tokens_per_s"]
    del lathe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _fmt(row: dict) -> str:
    if "error" in row:
        return row["error"]
    keys = ("tokens_per_s", "step_s", "mfu_vs_datasheet", "mfu_vs_measured_matmul", "peak_memory_gib", "loss",
            "first_step_s", "head_fwd_bwd_s")
    return ", ".join(f"{k}={row[k]:.4g}" for k in keys if k in row)


def goals(results: dict) -> dict:
    out = {}
    m = results["models"].get("1.5b", {})
    if "speedup_vs_transformers_padded" in m:
        out["speedup_1.5b"] = {"goal": 2.0, "got": m["speedup_vs_transformers_padded"],
                               "met": m["speedup_vs_transformers_padded"] >= 2.0}
    if "mfu_vs_datasheet" in m.get("lathe_packed", {}):
        got = m["lathe_packed"]["mfu_vs_datasheet"]
        out["mfu_1.5b"] = {"goal": 0.40, "got": got, "met": got >= 0.40}
    ratios = {k: v["logprob_step"].get("peak_ratio_full_over_chunked") for k, v in results["models"].items()
              if "logprob_step" in v}
    ratios = {k: r for k, r in ratios.items() if r}
    if ratios:
        out["logprob_memory"] = {"goal": 4.0, "got": ratios, "met": all(r >= 4.0 for r in ratios.values())}
    return out


def print_table(results: dict) -> None:
    print(f"\n{results['device']} | torch {results['torch']} | transformers {results['transformers']} | "
          f"{results['tokens_per_step']} tokens/step, lengths {results['min_len']}-{results['max_len']}")
    print(f"{'model':6} {'impl':26} {'tok/s':>9} {'step s':>7} {'MFU':>6} {'peak GiB':>9} {'loss':>8}")
    for name, m in results["models"].items():
        for impl in ("lathe_packed", "lathe_packed_eager", "transformers_padded", "transformers_unpadded_mb1"):
            r = m.get(impl)
            if not r:
                continue
            if "error" in r:
                print(f"{name:6} {impl:26} {r['error'][:60]}")
                continue
            mfu = r.get("mfu_vs_datasheet")
            if impl == "lathe_packed":
                impl += " (compiled)" if r.get("use_torch_compile") else " (eager)"
            print(f"{name:6} {impl:26} {r['tokens_per_s']:9.0f} {r['step_s']:7.3f} "
                  f"{(f'{mfu:.1%}' if mfu else '-'):>6} {r.get('peak_memory_gib', 0):9.1f} {r['loss']:8.4f}")
        lp = m.get("logprob_step", {})
        if "peak_ratio_full_over_chunked" in lp:
            print(f"{name:6} log-prob step peak GiB: chunked {lp['chunked']['peak_memory_gib']:.2f}, full logits "
                  f"{lp['full_logits']['peak_memory_gib']:.2f} ({lp['peak_ratio_full_over_chunked']:.1f}x); "
                  f"speedup vs transformers padded {m.get('speedup_vs_transformers_padded', 0):.2f}x")
    print("goals:", json.dumps(results["goals"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="0.5b,1.5b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--hf-micro-batch", type=int, default=4)
    p.add_argument("--skip-mb1", action="store_true", help="skip transformers with one sequence per micro-batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--no-compile", dest="use_torch_compile", action="store_false",
                   help="the trainer with actor.use_torch_compile=false (lathe_packed runs eager)")
    p.add_argument("--force-compile", action="store_true",
                   help="compile lathe even off CUDA (where the trainer runs eager): a CPU smoke test of the path")
    p.add_argument("--skip-eager", dest="eager", action="store_false",
                   help="skip the lathe_packed_eager comparison row")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--out", default=None, help="JSON path; default bench/results/train_<device>.json")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers
    name = device_name(device)
    peaks = {"datasheet": datasheet_peak(name), "measured_matmul": measured_matmul_tflops(device, dtype)}
    results = {"bench": "train", "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
               "cuda": torch.version.cuda, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "dtype": str(dtype).replace("torch.", ""),
               "tokens_per_step": args.tokens, "min_len": args.min_len, "max_len": args.max_len,
               "hf_micro_batch": args.hf_micro_batch, "peak_bf16_tflops_datasheet": peaks["datasheet"],
               "bf16_matmul_tflops_measured": peaks["measured_matmul"], "command": " ".join(sys.argv),
               "models": {}, "errors": {}}
    out = Path(args.out or ROOT / "bench" / "results" / f"train_{slug(name)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for shape_name in args.models.split(","):
        print(f"== {shape_name}", flush=True)
        try:
            results["models"][shape_name] = bench_model(shape_name, device, dtype, peaks, args)
        except Exception as e:   # keep what finished; say what broke
            results["errors"][shape_name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            traceback.print_exc()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results["goals"] = goals(results)
        out.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
