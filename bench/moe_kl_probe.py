"""GPT-OSS's actor/kl_loss at step 1: the reference's response log-probs against the actor's, per factor (eager or
compiled, train or eval mode, grad or not, micro-batch, attention backend), each against a float32 forward with the
explicit attention; K3 KL, mean and max |difference| per pair. A random-weight checkpoint of `--shape` (bench
SHAPES), 16 rows of 256 + 256 random tokens on CUDA (4 of 24 + 12 on the CPU, where everything is float32 and eager).

    python bench/moe_kl_probe.py --shape gpt-oss-20b-4l --out OUT.json

Found (kl_probe_gpt-oss-20b-4l_nvidia-h200.json): every bf16 forward is K3 ~0.06 from the float32 one and compiled
against eager ~0.05 (routing near-ties of random weights amplify rounding); the reference and the actor agree bit
for bit when they run the same kernels in one process."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import SHAPES, default_workdir, device_name, git_sha, write_model  # noqa: E402

from lathe.generation import RolloutOutput  # noqa: E402
from lathe.models.compile import maybe_compile  # noqa: E402
from lathe.models.frozen import frozen_copy  # noqa: E402
from lathe.models.hf import load_policy  # noqa: E402
from lathe.models.rope import cast_keeping_rope  # noqa: E402
from lathe.rollout.base import to_batch  # noqa: E402
from lathe.train.logprob import batched_log_probs, batched_token_stats  # noqa: E402

# pairs compared beside each forward against the float32 one
PAIRS = [("ref_eager", "actor_eager_train_grad"), ("ref_compiled", "actor_compiled_train_grad"),
         ("ref_compiled", "actor_compiled_train_nograd"), ("ref_eager", "ref_compiled"),
         ("actor_eager_train_grad", "actor_compiled_train_grad"), ("ref_eager", "ref_eager_sdpa"),
         ("actor_eager_train_nograd", "actor_eager_eval_nograd"), ("ref_eager", "actor_eager_train_nograd")]


def k3(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    """K3 KL (exp(d) - d - 1, d = a - b) and |d| over the real response tokens."""
    d = (a - b)[mask]
    return {"k3": float((torch.exp(d) - d - 1).mean()), "mean_abs": float(d.abs().mean()),
            "max_abs": float(d.abs().max())}


def forwards(path: Path, batch, device: torch.device) -> dict[str, torch.Tensor]:
    """Each variant's (B, R) response log-probs (float64, CPU): the actor as `lathe train` holds it with
    model_dtype=bf16 (its own weights cast, train mode) and the reference as `frozen_copy` of it."""
    bf = torch.bfloat16 if device.type == "cuda" else torch.float32

    def lp(model, grad=False, micro=16, stats=False):
        with torch.enable_grad() if grad else torch.no_grad():
            if stats or grad:       # the actor's passes take the entropy too
                x = batched_token_stats(model, batch, micro_batch_size=micro, temperature=1.0,
                                        calculate_entropy=True, remove_padding=True)[0]
            else:                   # the reference's
                x = batched_log_probs(model, batch, micro_batch_size=micro, temperature=1.0, remove_padding=True)[0]
        return x.detach().double().cpu()

    base = load_policy(str(path))                      # float32 on the CPU, as the trainer loads it
    truth = frozen_copy(base, torch.float32, device)
    truth.attn_backend = "sdpa"                        # sinks and windows: the explicit softmax
    vals = {"fp32_sdpa": lp(truth)}
    del truth
    actor = cast_keeping_rope(base, bf, device).train()
    ref = frozen_copy(actor, bf, device)
    vals["ref_eager"] = lp(ref)
    vals["ref_eager_micro8"] = lp(ref, micro=8)
    vals["actor_eager_train_nograd"] = lp(actor)
    vals["actor_eager_train_grad"] = lp(actor, grad=True, micro=8)
    vals["actor_eager_eval_nograd"] = lp(actor.eval())
    actor.train()
    ref_sdpa = frozen_copy(actor, bf, device)
    ref_sdpa.attn_backend = "sdpa"
    vals["ref_eager_sdpa"] = lp(ref_sdpa)
    del ref_sdpa
    maybe_compile(ref, True, device=device)            # (on CUDA; the CPU stays eager)
    maybe_compile(actor, True, device=device)
    vals["ref_compiled"] = lp(ref)
    vals["actor_compiled_train_nograd"] = lp(actor, stats=True)
    vals["actor_compiled_train_grad"] = lp(actor, grad=True, micro=8)
    return vals


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="gpt-oss-20b-4l")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workdir", default=default_workdir("lathe-klprobe"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, t0 = torch.device(args.device), time.time()
    path = write_model(args.shape, Path(args.workdir), args.device)
    vocab = SHAPES[args.shape]["vocab_size"]
    P, R, rows = (256, 256, 16) if device.type == "cuda" else (24, 12, 4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (P,), generator=g).tolist() for _ in range(rows)]
    resps = [torch.randint(2, vocab, (R,), generator=g).tolist() for _ in range(rows)]
    batch = to_batch(prompts, RolloutOutput(resps, [[0.0] * R for _ in resps], ["length"] * rows), 0, n=1)
    mask = batch["response_mask"].bool()
    vals = forwards(path, batch.to(device), device)
    pairs = {f"{n} vs fp32_sdpa": k3(vals[n], vals["fp32_sdpa"], mask) for n in vals}
    pairs.update({f"{a} vs {b}": k3(vals[a], vals[b], mask) for a, b in PAIRS})
    doc = {"what": "bench/moe_kl_probe.py: " + __doc__.split("\n\n")[0].replace("\n", " "), "shape": args.shape,
           "device": device_name(device), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
               timespec="seconds"), "git_sha": git_sha(), "command": " ".join(sys.argv), "pairs": pairs,
           "wall_s": time.time() - t0}
    for k, v in pairs.items():
        print(f"{k:60s} k3 {v['k3']:.3g}  mean|d| {v['mean_abs']:.3g}  max|d| {v['max_abs']:.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
