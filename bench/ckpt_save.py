"""What a checkpoint save costs, and the manifest's share of it (issue 42: the hash must cost < 5% of a save).

    python bench/ckpt_save.py --model 1.5b --saves 3 --out bench/results/ckpt_save_1.5b_nvidia-h200.json

Builds the `lathe train` run of `bench/e2e.py` (random-weight Qwen2.5 shape, GRPO, one GPU), trains one step, then
saves the checkpoint `--saves` times through the loop's own `save` (every part, `trainer_state.pt`, the manifest,
the rename), timing the whole save and, inside it, `write_manifest` (the hashing of every file). Writes JSON
(device, date, git sha, checkpoint bytes, seconds per save and per manifest, their ratio, hash MB/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import REWARD_FILE, SHAPES, device_name, git_sha, write_data, write_model, write_tokenizer  # noqa: E402
from e2e import lathe_command  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny shape)")
    p.add_argument("--workdir", default="/tmp/lathe-ckpt")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    run_args = argparse.Namespace(prompts=8, n=4, prompt_len=64, response_len=64, gpu_memory_utilization=0.3,
                                  steps=1, device=args.device, gpus=1, extra=[], profile_step=0, profile_stack=False)
    where = Path(args.workdir)
    where.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.model]["vocab_size"]
    parquet, _ = write_data(where, rows=64, prompt_len=run_args.prompt_len, vocab_size=vocab)
    (where / "reward.py").write_text(REWARD_FILE)
    paths = {"model": write_model(args.model, where, args.device), "tokenizer": write_tokenizer(vocab, where),
             "parquet": parquet, "reward": where / "reward.py", "run": where / "run"}
    overrides = lathe_command(args.model, paths, run_args)[5:]      # after `python -m lathe train base`

    from lathe.ckpt import checkpoint
    from lathe.config import load_config
    from lathe.loop import ppo
    from lathe.loop.setup import build_trainer
    manifest_s: list[float] = []
    real = checkpoint.manifest.write_manifest

    def timed(root, **kw):
        start = time.perf_counter()
        out = real(root, **kw)
        manifest_s.append(time.perf_counter() - start)
        return out

    checkpoint.manifest.write_manifest = timed
    trainer = build_trainer(load_config("base", overrides))
    try:
        ppo.fit(trainer)
        save_s = []
        for _ in range(args.saves):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            ppo.save(trainer)
            save_s.append(time.perf_counter() - start)
        step = checkpoint.step_dir(Path(trainer.cfg.trainer.default_local_dir), trainer.global_step)
        nbytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    finally:
        trainer.close()
    ratio = [m / s for m, s in zip(manifest_s, save_s)]
    result = {"bench": "ckpt_save", "device": device_name(torch.device(args.device)), "date": datetime.date.today().isoformat(),
              "git_sha": args.git_sha or git_sha(), "model": args.model, "checkpoint_bytes": nbytes,
              "save_seconds": [round(s, 2) for s in save_s], "manifest_seconds": [round(m, 2) for m in manifest_s],
              "manifest_share": [round(r, 4) for r in ratio],
              "hash_mb_per_s": [round(nbytes / 1e6 / m, 1) for m in manifest_s],
              "what": f"{args.model}: a checkpoint of {nbytes / 1e9:.1f} GB saved in {min(save_s):.1f}-{max(save_s):.1f} s, "
                      f"of which the manifest's hashing {min(manifest_s):.2f}-{max(manifest_s):.2f} s "
                      f"({100 * min(ratio):.1f}-{100 * max(ratio):.1f}%)"}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
