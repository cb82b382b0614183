"""The README's performance table, generated from bench/results/.

    python bench/table.py            # print the table (markdown)
    python bench/table.py --write    # rewrite it in README.md, between the two marker comments
    python bench/table.py --check    # exit 1 when README.md's table differs from what bench/results/ gives

Figures of record: for each bench (e2e, rollout, train, sft, reward_curve, ckpt_save), device, GPU count, model shape and load,
the latest result. A result is a bench's own output (its `models` in the shape the bench writes, with `device`,
`date` and `git_sha`), either a whole file or one stored inside another file (e.g. the e2e run kept in
`rollout_close_*.json`). Left out: A/B comparisons (files named `*_ab_*`), runs whose `git_sha` is not a plain commit
(an A/B arm such as `a33534b-old`), a comparison's baseline arm (stored under a key such as `old_1` or `base`), runs
through the one-GPU Ray path (`--ray`), rollout runs with admission changed, a fixed load of other sizes or another
KV cache first, and e2e runs off the bench's default workload (other lengths, extra keys such as LoRA; a key that
restates the bench's own gradient checkpointing for the shape is not one) or with a profiled step. "Latest" is by
`date` (no time of day counts as midnight UTC).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- bench/table.py: begin (generated from bench/results/; do not edit by hand) -->"
END = "<!-- bench/table.py: end -->"
SHA = re.compile(r"^[0-9a-f]{7,40}$")
BASELINE = re.compile(r"(^|_)(old|base|before|no)")
E2E_WORKLOAD = {"prompts": 32, "n": 8, "prompt_len": 256, "response_len": 512}
SHAPE_NAMES = {"tiny": "tiny", "0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B"}


def when(doc: dict) -> datetime.datetime | None:
    try:
        t = datetime.datetime.fromisoformat(str(doc.get("date")))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


def candidates(node, label: str = ""):
    """Every dict in a results file that is a bench's own output (`models`, `device`, `date`, a plain `git_sha`),
    except the baseline arms of a comparison (stored under a key such as `old_1`, `base`, `before`)."""
    if not isinstance(node, dict) or BASELINE.search(label):
        return
    if (isinstance(node.get("models"), dict) and node.get("device") and when(node)
            and SHA.match(str(node.get("git_sha", "")))):
        yield node
    for key, value in node.items():
        yield from candidates(value, str(key))


def kind_of(doc: dict, name: str) -> str | None:
    """Which bench wrote `doc`: told by the shape of its model rows."""
    rows = [r for r in doc["models"].values() if isinstance(r, dict)]
    if any("lathe_packed" in r for r in rows):
        return "train"
    if any(isinstance(r.get("loads"), dict) for r in rows):
        return "rollout"
    lathe = [r["lathe"] for r in rows if isinstance(r.get("lathe"), dict) and "step_s" in r["lathe"]]
    if lathe:
        return "sft" if any(" lathe sft " in f" {la.get('command', '')} " for la in lathe) else "e2e"
    return None


def fmt_k(x: float) -> str:
    return f"{x / 1000:.1f}k"


CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing="


def restated(extra: str, settings: dict) -> bool:
    """An extra key that only says again what bench/e2e.py sets for the shape (its gradient checkpointing)."""
    return "checkpointing" in settings and extra == CHECKPOINTING + str(settings["checkpointing"]).lower()


def measured_rate_mfu(doc: dict, la: dict) -> float | None:
    """The update's model FLOPs over the matmul rate measured on the device (`roofline.DEVICE_RATES`, 790 TFLOP/s on
    H100 and H200): issue 48's "update MFU of the measured matmul rate". `update_mfu` is over the datasheet peak."""
    if la.get("update_mfu_measured_rate"):
        return la["update_mfu_measured_rate"]
    from roofline import device_rates
    rate, peak = device_rates(str(doc.get("device", "")))[0], doc.get("peak_bf16_tflops_datasheet")
    return la["update_mfu"] * peak * 1e12 / rate if la.get("update_mfu") and rate and peak else None


def e2e_rows(doc: dict):
    w = doc.get("workload", {})
    if any(w.get(k) != v for k, v in E2E_WORKLOAD.items()) or w.get("ray") \
            or w.get("profile_step"):      # a profiled step among the timed ones carries the profiler's cost
        return
    for shape, m in doc["models"].items():
        la, trl = m.get("lathe", {}), m.get("trl", {})
        if not la.get("step_s") or not all(restated(e, m.get("lathe_settings", {})) for e in w.get("extra") or ()):
            continue
        ph = la.get("phases_s", {})
        text = f"`lathe train` GRPO {la['step_s']:.2f} s/step (rollout {ph.get('gen', 0):.2f} s, update " \
               f"{ph.get('update_actor', 0):.2f} s"
        measured = measured_rate_mfu(doc, la)
        text += f", update MFU {la['update_mfu']:.1%}" if la.get("update_mfu") else ""
        text += f" of the datasheet peak, {measured:.1%} of the measured matmul rate" if measured else ""
        text += ")"
        sol = (la.get("speed_of_light") or {}).get("step", {}).get("fraction")
        if sol is not None:     # results written before bench/roofline.py have none
            text += f", at {sol:.1%} of speed of light"
        if trl.get("step_s") and m.get("speedup_vs_trl"):
            text += f"; TRL {trl['step_s']:.2f} s/step in the same call, {m['speedup_vs_trl']:.2f}×"
        yield (shape, la.get("gpus", w.get("gpus", 1)), "", text)


FIXED_LOAD = {"prompts": 256, "prompt_len": 256, "new_tokens": 512}     # bench/rollout.py's fixed load


def rollout_rows(doc: dict):
    a = doc.get("args", {})
    if a.get("no_reserve") or a.get("overcommit") is not None or a.get("step_by_step"):
        return
    if (a.get("kv_cache_dtype") or ["auto"])[0] != "auto":     # the `lathe` rows ran over another KV cache
        return
    for shape, m in doc["models"].items():
        for load, r in (m.get("loads") or {}).items():
            la = r.get("lathe", {}) if isinstance(r, dict) else {}
            if not la.get("tok_s") or (load == "fixed" and any(a.get(k, v) != v for k, v in FIXED_LOAD.items())):
                continue
            text = f"engine {fmt_k(la['tok_s'])} tok/s"
            if la.get("roofline_fraction"):
                text += f", {la['roofline_fraction']:.1%} of the decode roofline"
            touched = la.get("roofline_touched_fraction")
            if touched and abs(touched - la.get("roofline_fraction", 0)) > 1e-3:     # a MoE: the experts it reads
                text += f" ({touched:.1%} counting every expert a step touches)"
            if la.get("preemptions"):
                text += f", {la['preemptions']} preemptions"
            yield (shape, 1, load, text)


def train_rows(doc: dict):
    for shape, m in doc["models"].items():
        la = m.get("lathe_packed", {})
        if not la.get("tokens_per_s"):
            continue
        text = f"decoder fwd+bwd {fmt_k(la['tokens_per_s'])} tok/s"
        if la.get("mfu_vs_datasheet"):
            text += f", MFU {la['mfu_vs_datasheet']:.1%}"
        if m.get("speedup_vs_transformers_padded"):
            text += f"; {m['speedup_vs_transformers_padded']:.2f}× transformers padded"
        yield (shape, 1, "", text)


def sft_rows(doc: dict):
    if doc.get("workload", {}).get("ray"):
        return
    for shape, m in doc["models"].items():
        la, trl = m.get("lathe", {}), m.get("trl", {})
        if not la.get("step_s"):
            continue
        text = f"`lathe sft` {la['step_s']:.2f} s/step"
        if la.get("mfu"):
            text += f", MFU {la['mfu']:.1%}"
        if trl.get("step_s") and m.get("speedup_vs_trl"):
            text += f"; TRL {trl['step_s']:.2f} s/step, {m['speedup_vs_trl']:.2f}×"
        yield (shape, 1, "", text)


ROWS = {"e2e": e2e_rows, "rollout": rollout_rows, "train": train_rows, "sft": sft_rows}


def reward_curve(path: Path):
    doc = json.loads(path.read_text())
    if doc.get("bench") != "reward_curve" or not when(doc):
        return None
    preset = doc.get("preset", "default")
    text = (f"`{doc['command']}` built-in demo: critic/score/mean {doc['first_step_score']:.2f} at step 1 → "
            f"{doc['final_rolling10']:.2f} (10-step mean)")
    if "first_step_tool_calls" in doc:
        text += (f", agent/tool_calls/mean {doc['first_step_tool_calls']:.2f} → "
                 f"{doc['final_tool_calls_rolling10']:.2f}")
    text += f", {doc['wall_seconds']:.0f} s wall"
    if doc.get("grpo_seconds_to_rolling10_ge_0.95") is not None:
        text += f"; 10-step mean ≥ 0.95 after {doc['grpo_seconds_to_rolling10_ge_0.95']:.0f} s of GRPO steps"
    if doc.get("one_step_run_seconds"):
        cold, cached = doc["one_step_run_seconds"].values()
        text += f"; a 1-step run {cold:.0f} s, {cached:.0f} s with the warm start cached"
    kind = "reward_curve" if preset == "default" else f"reward_curve ({preset})"
    return (kind, doc["device"], 0, "builtin:tiny", ""), (when(doc), doc, text, path.name)


def ckpt_save(path: Path):
    doc = json.loads(path.read_text())
    if doc.get("bench") != "ckpt_save" or not when(doc):
        return None
    return ("ckpt_save", doc["device"], 1, doc["model"], ""), (when(doc), doc, doc["what"], path.name)


@functools.lru_cache(maxsize=None)
def _committed(name: str) -> int:
    """When results file `name` was first committed (unix seconds; later than any commit when not committed yet)."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%ct", "--", f"bench/results/{name}"],
                         cwd=RESULTS.parents[1], capture_output=True, text=True, check=False).stdout.split()
    return int(out[-1]) if out else 2**62


def records(results: Path = RESULTS) -> dict:
    """{(bench, device, gpus, shape, load): (when, doc, text, file)}, the latest of each."""
    best: dict = {}

    def offer(key, value):      # the later date; on the same day, the file committed later
        if key not in best or (value[0], _committed(value[3])) > (best[key][0], _committed(best[key][3])):
            best[key] = value
    for path in sorted(results.glob("*.json")):
        if "_ab_" in path.name or path.name.endswith("_ab.json"):
            continue
        rc = reward_curve(path) or ckpt_save(path)
        if rc:
            offer(*rc)
            continue
        for doc in candidates(json.loads(path.read_text())):
            kind = kind_of(doc, path.name)
            if kind is None:
                continue
            for shape, gpus, load, text in ROWS[kind](doc):
                offer((kind, doc["device"], gpus, shape, load), (when(doc), doc, text, path.name))
    return best


def table(results: Path = RESULTS) -> str:
    order = {k: i for i, k in enumerate(("e2e", "sft", "rollout", "train", "reward_curve", "ckpt_save"))}
    shapes = {k: i for i, k in enumerate(SHAPE_NAMES)}
    recs = records(results)
    lines = ["| bench | device | model | figure | date | commit | results file |", "|---|---|---|---|---|---|---|"]
    for key in sorted(recs, key=lambda k: (order[k[0].split()[0]], k[0], k[1], k[2], shapes.get(k[3], 9), k[4])):
        kind, device, gpus, shape, load = key
        t, doc, text, name = recs[key]
        dev = f"{gpus}× {device}" if gpus and gpus > 1 else device
        model = SHAPE_NAMES.get(shape, shape) + (f", {load} load" if load else "")
        lines.append(f"| {kind} | {dev} | {model} | {text} | {t.date().isoformat()} | {str(doc['git_sha'])[:7]} | "
                     f"`{name}` |")
    return "\n".join(lines) + "\n"


def splice(readme: str, body: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md has no table markers; put these two lines where the table goes:\n{BEGIN}\n{END}")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite README.md's table")
    g.add_argument("--check", action="store_true", help="exit 1 when README.md's table is stale")
    p.add_argument("--readme", type=Path, default=README)
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    body = table(args.results)
    if not (args.write or args.check):
        sys.stdout.write(body)
        return 0
    text = args.readme.read_text()
    new = splice(text, body)
    if args.check:
        if new != text:
            print(f"{args.readme} performance table is stale: run python bench/table.py --write", file=sys.stderr)
            return 1
        return 0
    args.readme.write_text(new)
    print(f"wrote the table into {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
