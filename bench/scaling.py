"""Weak and strong scaling of `lathe train` in one call: bench/e2e.py's GRPO step on 1 GPU and on more, per phase.

    python bench/scaling.py --model 1.5b --gpus 1,2,4 --git-sha SHA --out bench/results/e2e_scaling_1.5b_<kind>.json
    python bench/scaling.py --gpus 1,4 --no-weak --profile-step 3 --extra actor_rollout_ref.actor.use_kl_loss=true

Arms, each a bench/e2e.py child (its JSON under `--workdir`, embedded whole in this one's `runs`), in this order:
`g1` (one GPU, `--prompts` prompts), then for each larger G `gG` (G GPUs, the same prompts: strong scaling) and
`gGw` (G GPUs, G times the prompts: the same samples per GPU, weak scaling; `--no-weak` leaves them out). The
summary gives each ratio from this one call: strong speed-up = g1's step / gG's, weak efficiency = g1's step /
gGw's, and the same per phase (gen, ref, old_log_prob, update_actor). `--profile-step` profiles that step of the
strong arm on the most GPUs (every rank's kernel summary in its run; the step is left out of its median).

`--budget` seconds bound the whole call: an arm starts only with `--arm-min` seconds left, and each runs under the
smaller of `--timeout` and what is left, so a device call's limit cuts no arm mid-write; the JSON is written after
every arm. An arm that failed (or was cut) keeps its return code and its log's path, and the ratios it would give are
left out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import claim_workdir, default_workdir, run_child  # noqa: E402

PHASES = ("gen", "ref", "old_log_prob", "update_actor", "update_weights")


def arms(gpus: list[int], prompts: int, weak: bool) -> list[tuple[str, int, int]]:
    """(name, GPUs, prompts) of each arm, in the order they run: one GPU first, then strong, then weak."""
    if gpus[0] != 1 or sorted(set(gpus)) != gpus:
        raise SystemExit(f"--gpus {','.join(map(str, gpus))}: ascending, from 1 (every ratio is against one GPU)")
    out = [("g1", 1, prompts)] + [(f"g{g}", g, prompts) for g in gpus[1:]]
    return out + ([(f"g{g}w", g, prompts * g) for g in gpus[1:]] if weak else [])


def row(run: dict) -> dict | None:
    """An e2e JSON's lathe row (its only model), or None where the run wrote no step."""
    models = run.get("models") or {}
    lathe = next(iter(models.values()), {}).get("lathe") if models else None
    return lathe if lathe and lathe.get("step_s") else None


def summary(runs: dict[str, dict], gpus: list[int]) -> dict:
    """Step and phase seconds per arm, and each ratio against `g1` whose two arms both ran."""
    rows = {name: row(run) for name, run in runs.items()}
    out = {"step_s": {n: r["step_s"] for n, r in rows.items() if r},
           "phases_s": {n: {p: r["phases_s"][p] for p in PHASES if r["phases_s"].get(p)} for n, r in rows.items()
                        if r}}
    base = rows.get("g1")
    if base is None:
        return out
    for g in gpus[1:]:
        for name, key, per_phase in ((f"g{g}", f"strong_speedup_{g}", f"phase_strong_speedup_{g}"),
                                     (f"g{g}w", f"weak_efficiency_{g}", f"phase_weak_efficiency_{g}")):
            r = rows.get(name)
            if r is None:
                continue
            out[key] = round(base["step_s"] / r["step_s"], 3)
            out[per_phase] = {p: round(base["phases_s"][p] / r["phases_s"][p], 3) for p in PHASES
                              if base["phases_s"].get(p) and r["phases_s"].get(p) and p != "update_weights"}
    return out


def what(args, s: dict) -> str:
    """One line a reader can quote: the workload, then each ratio with the seconds it comes from."""
    line = (f"lathe train at {args.model} (bench/e2e.py's GRPO step, {args.prompts} prompts x {args.n}, "
            f"extra {' '.join(args.extra) or 'none'}) on 1 to {args.gpus[-1]} GPUs, one call at {args.git_sha}: "
            f"1 GPU {s['step_s'].get('g1', float('nan')):.2f} s/step")
    for g in args.gpus[1:]:
        if f"strong_speedup_{g}" in s:
            line += f"; {g} GPUs same batch {s['step_s'][f'g{g}']:.2f} s ({s[f'strong_speedup_{g}']:.2f}x)"
        if f"weak_efficiency_{g}" in s:
            line += (f"; {g} GPUs {g}x the batch {s['step_s'][f'g{g}w']:.2f} s "
                     f"({100 * s[f'weak_efficiency_{g}']:.1f}% weak-scaling efficiency)")
    return line


def save(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1.5b")
    p.add_argument("--gpus", default="1,2", help="ascending comma list from 1")
    p.add_argument("--prompts", type=int, default=32, help="prompts a step on one GPU (and in each strong arm)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-weak", dest="weak", action="store_false")
    p.add_argument("--profile-step", type=int, default=0)
    p.add_argument("--extra", nargs="*", default=[], metavar="key=value")
    p.add_argument("--timeout", type=float, default=300, help="seconds an arm may run")
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds the whole call may run")
    p.add_argument("--arm-min", type=float, default=100, help="seconds an arm needs left to start")
    p.add_argument("--workdir", default=default_workdir("lathe-scaling"))
    p.add_argument("--git-sha", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.gpus = [int(g) for g in args.gpus.split(",")]
    plan = arms(args.gpus, args.prompts, args.weak)
    where = claim_workdir(Path(args.workdir))
    start, out = time.monotonic(), Path(args.out)
    result = {"bench": "e2e_scaling", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_sha": args.git_sha, "command": " ".join(sys.argv), "arms": {}, "runs": {}}
    for name, g, prompts in plan:
        left = args.budget - (time.monotonic() - start)
        if left < args.arm_min:
            result["arms"][name] = {"gpus": g, "prompts": prompts, "skipped": f"{left:.0f} s left of --budget"}
            save(out, result)
            continue
        limit = min(args.timeout, left - 5)
        profile = (["--profile-step", str(args.profile_step)]
                   if args.profile_step and g == args.gpus[-1] and prompts == args.prompts and g > 1 else [])
        arm_json, log = where / f"{name}.json", where / f"{name}.log"
        arm_json.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "bench" / "e2e.py"), "--systems", "lathe", "--models", args.model,
               "--gpus", str(g), "--prompts", str(prompts), "--n", str(args.n), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--timeout", str(max(30, limit - 15)), "--workdir", str(where / name),
               "--git-sha", str(args.git_sha), *profile, "--out", str(arm_json),
               *(["--extra", *args.extra] if args.extra else [])]
        rc, wall = run_child(cmd, log, limit)
        run = json.loads(arm_json.read_text()) if arm_json.exists() else {}
        result["arms"][name] = {"gpus": g, "prompts": prompts, "returncode": rc, "wall_s": round(wall, 1),
                                "log": str(log)}
        if run:
            result["runs"][name] = run
            result.setdefault("device", run.get("device"))
            result.setdefault("torch", run.get("torch"))
        result["summary"] = summary(result["runs"], args.gpus)
        result["what"] = what(args, result["summary"])
        save(out, result)
        print(f"{name}: rc {rc}, {wall:.0f} s, step {result['summary']['step_s'].get(name, float('nan')):.2f} s",
              flush=True)
    print(result.get("what", "no arm ran"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
