"""What a checkpoint save costs, and the hash's share of it (issue 42: the hash must cost < 5% of a save).

    python bench/ckpt_save.py --model 1.5b --saves 3 --out bench/results/ckpt_save_1.5b_nvidia-h200.json

Builds the `lathe train` run of `bench/e2e.py` (random-weight Qwen2.5 shape, GRPO, one GPU), trains one step, then
saves the checkpoint through the loop's own `save` (every part, `trainer_state.pt`, the manifest, the rename),
`--saves` rounds of three saves in turn:
- `lathe`: as lathe saves (optim.pt hashed while it is written, the weights hashed meanwhile: ckpt.manifest.save_hashed);
- `after`: every file hashed by `write_manifest` once all are written (lathe before save-time hashing);
- `none`: no hashing at all (digests replaced by a constant): the save's own cost.
The hash's cost is a mode's median save time minus `none`'s, as a share of that mode's. Also timed: `write_manifest`
inside each save. Writes JSON (device, date, git sha, checkpoint bytes, seconds per save and mode, the shares).
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import (REWARD_FILE, SHAPES, claim_workdir, default_workdir, device_name, git_sha, print_and_write,  # noqa: E402
                    write_data, write_model, write_tokenizer)
from e2e import lathe_command  # noqa: E402

MODES = {"lathe": "as lathe saves (hashed while written)", "after": "hashing after the write",
         "none": "without hashing"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny shape)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="7b: 0.6 (its weights take 57 GiB)")
    p.add_argument("--workdir", default=default_workdir("lathe-ckpt"))
    p.add_argument("--git-sha", default=None)
    p.add_argument("--modes", default="lathe,after,none", help="which of lathe,after,none to time (none is needed)")
    p.add_argument("--delete-previous", action="store_true",
                   help="remove the step's checkpoint before each save (at 7B two copies do not fit a 128 GB disk)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    run_args = argparse.Namespace(prompts=8, n=4, prompt_len=64, response_len=64,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  steps=1, device=args.device, gpus=1, extra=[], profile_step=0, profile_stack=False)
    where = claim_workdir(Path(args.workdir))
    where.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.model]["vocab_size"]
    parquet, _ = write_data(where, rows=64, prompt_len=run_args.prompt_len, vocab_size=vocab)
    (where / "reward.py").write_text(REWARD_FILE)
    paths = {"model": write_model(args.model, where, args.device), "tokenizer": write_tokenizer(vocab, where),
             "parquet": parquet, "reward": where / "reward.py", "run": where / "run"}
    overrides = lathe_command(args.model, paths, run_args)[5:]      # after `python -m lathe train base`

    import statistics

    from lathe.ckpt import checkpoint, manifest
    from lathe.config import load_config
    from lathe.loop import ppo
    from lathe.loop.setup import build_trainer
    from lathe.train import update
    manifest_s: list[float] = []
    real_write, real_hash, real_saved = manifest.write_manifest, manifest.hash_files, manifest.save_hashed

    def timed(root, **kw):
        start = time.perf_counter()
        out = real_write(root, **kw)
        manifest_s.append(time.perf_counter() - start)
        return out

    def plain_save(obj, path, *, written=()):
        torch.save(obj, path)

    modes = {"lathe": (real_saved, real_hash), "after": (plain_save, real_hash),
             "none": (plain_save, lambda paths, **kw: [(p.stat().st_size, "0") for p in paths])}
    modes = {m: modes[m] for m in args.modes.split(",")}
    checkpoint.manifest.write_manifest = timed
    trainer = build_trainer(load_config("base", overrides))
    save_s: dict[str, list[float]] = {m: [] for m in modes}
    inside: dict[str, list[float]] = {m: [] for m in modes}
    try:
        ppo.fit(trainer)
        for _ in range(args.saves):
            for mode, (saver, hasher) in modes.items():
                update.manifest.save_hashed, manifest.hash_files = saver, hasher
                step = checkpoint.step_dir(Path(trainer.cfg.trainer.default_local_dir), trainer.global_step)
                if args.delete_previous and step.exists():
                    shutil.rmtree(step)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                ppo.save(trainer)
                save_s[mode].append(time.perf_counter() - start)
                inside[mode].append(manifest_s[-1])
        step = checkpoint.step_dir(Path(trainer.cfg.trainer.default_local_dir), trainer.global_step)
        nbytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    finally:
        update.manifest.save_hashed, manifest.hash_files = real_saved, real_hash
        trainer.close()
    median = {m: statistics.median(v) for m, v in save_s.items()}
    share = {m: round((median[m] - median["none"]) / median[m], 4) for m in median if m != "none"}
    result = {"bench": "ckpt_save", "device": device_name(torch.device(args.device)),
              "date": datetime.date.today().isoformat(), "git_sha": args.git_sha or git_sha(), "model": args.model,
              "checkpoint_bytes": nbytes, "save_seconds": {m: [round(s, 2) for s in v] for m, v in save_s.items()},
              "write_manifest_seconds": {m: [round(s, 2) for s in v] for m, v in inside.items()},
              "median_save_seconds": {m: round(v, 2) for m, v in median.items()}, "hash_share": share,
              "what": f"{args.model}: a checkpoint of {nbytes / 1e9:.1f} GB; median save "
                      + ", ".join(f"{median[m]:.1f} s {MODES[m]}" for m in median) + "; the hash costs "
                      + ", ".join(f"{100 * v:.1f}% of a save {MODES[m]}" for m, v in share.items())}
    print_and_write(result, args.out)


if __name__ == "__main__":
    main()
