"""End to end: `lathe train` itself against TRL's GRPOTrainer on the same GRPO workload, one GPU.

    python bench/e2e.py [--models 0.5b,1.5b,7b] [--systems lathe,trl] [--steps 5] [--out bench/results/e2e_<device>.json]
    python bench/e2e.py --systems lathe --models 1.5b --gpus 2          # Ray workers + FSDP2 on 2 GPUs
    python bench/e2e.py --systems lathe --models 0.5b --ray             # one GPU through the distributed path
    python bench/e2e.py --systems lathe --models 1.5b --gpus 2 --teacher 7b \
        --extra distillation.distillation_loss.loss_mode=k3                # on-policy distillation from a 7B teacher
    python bench/e2e.py --device cpu --models tiny --systems lathe --steps 2 --prompts 4 --n 2 \
        --prompt-len 16 --response-len 8 --out /tmp/e2e_smoke.json                                   # CPU smoke test

The workload (the one that issue 9 measured): random-weight Qwen2.5 shapes (or another of bench/common.py's
SHAPES: Qwen3-MoE, GPT-OSS, Qwen3.5, Nemotron-H — `--models tiny-qwen3.5` (`tiny-nemotron`) for a CPU smoke run;
`qwen3.5-2b-vl`: the 2B as released, a Qwen3_5ForConditionalGeneration checkpoint), `--prompts` prompts x `--n` samples per step, prompts of exactly `--prompt-len` tokens (synthetic words of a synthetic word-level tokenizer with
the model's vocabulary size), exactly `--response-len` new tokens (lathe: `rollout.ignore_eos=true`; TRL:
`min_new_tokens`), a cheap custom reward, one optimizer step per RL step, no KL (7B: `use_kl_loss=true` in lathe,
the reference model on).

- lathe: the `lathe train` command (`python -m lathe train base key=value ...`) in a child process, exactly as a
  user runs it; per-step figures come from the run's `metrics.jsonl` (`timing_s/*`, `perf/*`).
- TRL: `bench/e2e_trl.py` in a child process: `GRPOTrainer` with its defaults (fp32 weights, bf16 autocast,
  gradient checkpointing, transformers `generate`), the same model directory, prompts, lengths and batch shape;
  `per_device_train_batch_size x gradient_accumulation_steps` = prompts x n (one optimizer step per generation).

Reported per model and system: median seconds per step over the steps after `--warmup` (compilation and
allocator warm-up excluded), per-phase seconds, tokens/s, the update phase's MFU (model FLOPs: 6 x linear
params + causal attention per token, over the datasheet bf16 peak, and as `update_mfu_measured_rate` over the
measured matmul rate of bench/roofline.py, issue 48's figure), peak GPU memory, lathe's energy and mean power
per phase where NVML reads them (`energy_j_by_phase`, `power_w_by_phase`, `power_limit_w`: `lathe.track.energy`), and
lathe/TRL speed-up.

Speed of light (lathe, `lathe.speed_of_light`): per phase (gen = prefill + decode, old_log_prob, ref, update_actor,
those the run reports; not the weight sync, which has no bound) `{"measured_s", "light_s", "fraction"}`, light_s
being the least time the hardware needs (bench/roofline.py: FLOPs over the measured matmul rate, decode bytes over the HBM bandwidth), and
`step`: the phases' light summed over the measured step. Decode assumes the batch (prompts x n, up to the engine's
`max_num_seqs`) decodes together with KV room for all of it. A mixture-of-experts shape's decode bound is issue 44's,
the *active* parameters; gen and step also carry `touched_light_s` / `touched_fraction`, the bound with the experts
that a step's rows are expected to touch (nearly all of them at a GRPO batch: what the step physically reads), and
gen `active_fraction_ceiling`, the most of the active bound reachable at that batch (bench/roofline.py's docstring).
A Qwen3.5 shape's decode also reads and writes back each sequence's linear-attention states. light_s and fraction are
null on a device without rates (CPU). Each model's `what` states the step's fraction.
Writes JSON after every run, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from common import (REWARD_FILE, SHAPES, VL_FORMS, claim_workdir, datasheet_peak, default_workdir,  # noqa: E402
                    device_name, driver_over_ranks, git_sha, lathe_row, run_child, slug, train_flops, write_data,
                    write_model, write_tokenizer)
from roofline import device_rates, grouped_forward_flops, step_light  # noqa: E402

# Per shape: lathe's micro-batch (sequences per forward/backward), gradient checkpointing, KL/ref, offload.
LATHE_SETTINGS = {
    "tiny": dict(micro=8, checkpointing=False, kl=False, extra=[]),
    "0.5b": dict(micro=32, checkpointing=False, kl=False, extra=[]),
    "1.5b": dict(micro=16, checkpointing=False, kl=False, extra=[]),
    # 7B: no recomputation at micro 8 (its activations fit an H200: peak 114.5 GiB; an 80 GB H100 needs
    # --extra actor_rollout_ref.model.enable_gradient_checkpointing=true): update 16.65 s, MFU 51.2%, against 20.10 s
    # recomputing every layer at micro 16 (e2e_fp8train_bf16_in_update_7b) and 18.19 s recomputing 14 of 28 layers
    # at micro 16 (e2e_gc14_micro16_7b), e2e_nogc_micro8_7b_nvidia-h200.json
    "7b": dict(micro=8, checkpointing=False, kl=True,
               extra=["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
    # larger and mixture-of-experts shapes (issues 43/44): several GPUs; the memory plan names what else they need
    "14b": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "32b": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "30b-a3b": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "30b-a3b-12l": dict(micro=16, checkpointing=True, kl=True, extra=[]),
    "30b-a3b-6l": dict(micro=16, checkpointing=True, kl=True, extra=[]),     # one GPU's MoE profile
    # GPT-OSS-20B on one H200 (issue 44): bf16 master weights and AdamW moments in host memory (the memory plan: 117
    # GiB on the device during the update, 78 GiB pinned on the host; fp32 masters would need 234 GiB); run it with
    # --gpu-memory-utilization 0.7 (the resident 78 GiB leave no KV cache at 0.5)
    "gpt-oss-20b": dict(micro=8, checkpointing=True, kl=True,
                        extra=["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                               "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
    "gpt-oss-20b-8l": dict(micro=8, checkpointing=True, kl=True,
                           extra=["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                                  "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
    "gpt-oss-20b-4l": dict(micro=8, checkpointing=True, kl=True,
                           extra=["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
                                  "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]),
    "tiny-moe": dict(micro=8, checkpointing=False, kl=False, extra=[]),
    # Qwen3.5 hybrids (issue 44): the 2B on one GPU, the 35B-A3B's layer cuts on 2 (its 40 layers: more); micro 8 in
    # the cuts: their 248k-token vocabulary's logits, beside 11B parameters' training state. The 2B trains without
    # gradient checkpointing, as the 1.5B does: its peak is 59.7 GiB on an H200 (9.54 s a step against 12.57 with it,
    # bench/results/e2e_qwen3.5-2b_no_ckpt_head_* and _ckpt_*)
    "qwen3.5-2b": dict(micro=16, checkpointing=False, kl=False, extra=[]),
    "qwen3.5-35b-a3b": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "qwen3.5-35b-a3b-12l": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "qwen3.5-35b-a3b-8l": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "tiny-qwen3.5": dict(micro=8, checkpointing=False, kl=False, extra=[]),
    # Nemotron-H (NVIDIA-Nemotron-3-Nano-30B-A3B's shape): its first 8 layers (4.8B) on one GPU, as 30b-a3b-6l (an H100
    # needs --extra actor_rollout_ref.actor.fsdp_config.optimizer_offload=true); the whole model on several
    "nemotron-nano": dict(micro=8, checkpointing=True, kl=True, extra=[]),
    "nemotron-nano-8l": dict(micro=16, checkpointing=True, kl=True, extra=[]),
    "tiny-nemotron": dict(micro=8, checkpointing=False, kl=False, extra=[]),
}
LATHE_SETTINGS.update({vl: LATHE_SETTINGS[text] for vl, text in VL_FORMS.items()})  # as released: the text shape's
# One GPU needs the 7B optimizer state in host memory; sharded over several GPUs it fits (and lathe refuses
# optimizer offload without parameter offload there), so these settings are dropped when --gpus > 1.
SINGLE_GPU_ONLY = ("actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                   "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16")
TRL_MICRO = {"tiny": 8, "0.5b": 32, "1.5b": 16, "7b": 8}

# -- the workload on disk ----------------------------------------------------------------------------------
# -- the two systems ---------------------------------------------------------------------------------------
def lathe_command(shape: str, paths: dict, args) -> list[str]:
    s = LATHE_SETTINGS[shape]
    extra = [e for e in s["extra"] if args.gpus == 1 or e not in SINGLE_GPU_ONLY]
    kl = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.001"] if s["kl"] else []
    return [sys.executable, "-m", "lathe", "train", "base",
            f"data.train_files={paths['parquet']}", "data.val_files=null", "trainer.test_freq=-1",
            f"data.train_batch_size={args.prompts}", f"data.max_prompt_length={args.prompt_len}",
            f"data.max_response_length={args.response_len}", "data.shuffle=false",
            f"actor_rollout_ref.model.path={paths['model']}", f"actor_rollout_ref.model.tokenizer_path={paths['tokenizer']}",
            "actor_rollout_ref.model.use_remove_padding=true",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={str(s['checkpointing']).lower()}",
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={args.n}",
            "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={min(s['micro'], args.prompts * args.n)}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={min(2 * s['micro'], args.prompts * args.n)}",
            "actor_rollout_ref.actor.optim.lr=1e-6", *kl, *extra,
            f"reward.custom_reward_function.path={paths['reward']}",
            f"trainer.total_training_steps={args.steps}", "trainer.logger=[console]", "trainer.save_freq=-1",
            "trainer.resume_mode=disable", f"trainer.device={args.device}", f"trainer.n_gpus_per_node={args.gpus}",
            f"trainer.default_local_dir={paths['run'] / 'lathe'}", *profile_keys(paths, args),
            *teacher_keys(paths), *args.extra]


def teacher_keys(paths: dict) -> list[str]:
    """--teacher: the distillation keys naming the written teacher (the loss keys come through --extra)."""
    if "teacher" not in paths:
        return []
    return ["distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={paths['teacher']}"]


def profile_keys(paths: dict, args) -> list[str]:
    """--profile-step N: lathe's global_profiler on step N (its trace and per-phase summary under the run dir)."""
    if not args.profile_step:
        return []
    return ["global_profiler.tool=torch", f"global_profiler.steps=[{args.profile_step}]",
            f"global_profiler.save_path={paths['run'] / 'lathe' / 'profile'}",
            *(["global_profiler.with_stack=true"] if args.profile_stack else [])]


def bench_model(shape: str, args, peak: float | None, rate: float | None = None) -> dict:
    where = claim_workdir(Path(args.workdir))
    where.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[shape]["vocab_size"]
    parquet, jsonl = write_data(where, rows=args.prompts * (args.steps + 1), prompt_len=args.prompt_len,
                                vocab_size=vocab)
    (where / "reward.py").write_text(REWARD_FILE)
    paths = {"model": write_model(shape, where, args.device), "tokenizer": write_tokenizer(vocab, where),
             "parquet": parquet, "jsonl": jsonl, "reward": where / "reward.py", "run": where / f"run-{shape}"}
    if args.teacher:
        paths["teacher"] = write_model(args.teacher, where, args.device, name="teacher", seed=1,
                                       tokenizer=paths["tokenizer"])
    seqs = args.prompts * args.n
    flops = train_flops(SHAPES[shape], [args.prompt_len + args.response_len] * seqs)
    if prefix_grouped(["base", *args.extra]):      # each prompt once for its n sequences (roofline.step_light)
        flops = 3 * grouped_forward_flops(SHAPES[shape], args.prompts, args.n, args.prompt_len, args.response_len,
                                          args.prompts * (args.prompt_len + args.n * args.response_len))
    res = {"shape": shape, "teacher": args.teacher, "sequences_per_step": seqs, "tokens_per_step": seqs * (args.prompt_len + args.response_len),
           "update_model_flops": flops, "update_flops_prefix_grouped": prefix_grouped(["base", *args.extra]),
           "lathe_settings": LATHE_SETTINGS[shape]}
    if "lathe" in args.systems:
        cmd = lathe_command(shape, paths, args)
        metrics = paths["run"] / "lathe" / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        summary = paths["run"] / "lathe" / "profile" / f"step_{args.profile_step}" / "summary.json"
        summary.unlink(missing_ok=True)                  # a previous run's must not pass for this one's
        env = {"LATHE_RAY": "1"} if args.ray else {}
        rc, wall = run_child(cmd, Path(args.logs) / f"lathe-{shape}.log", args.timeout, env)
        steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        res["lathe"] = {"command": " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd[1:]]), "returncode": rc,
                        "wall_s": wall, "gpus": args.gpus, "ray_workers": args.ray or args.gpus > 1,
                        **(lathe_row(steps, args.warmup, flops, peak and peak * args.gpus, args.profile_step,
                                      rate and rate * args.gpus) if steps else {})}
        if args.profile_step and summary.exists():
            res["lathe"]["profile"] = json.loads(summary.read_text())
            if args.gpus > 1:
                res["lathe"]["driver_over_ranks"] = driver_over_ranks(res["lathe"]["profile"])
        if steps:
            res["lathe"]["speed_of_light"] = kept_going("speed of light",
                                                        lambda: speed_of_light(shape, res["lathe"], args))
    if "trl" in args.systems and shape not in args.trl_skip:
        out = paths["run"] / "trl.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "bench" / "e2e_trl.py"), "--model", str(paths["model"]),
               "--tokenizer", str(paths["tokenizer"]), "--prompts-file", str(paths["jsonl"]), "--n", str(args.n),
               "--prompts", str(args.prompts), "--response-len", str(args.response_len), "--steps", str(args.trl_steps),
               "--micro", str(min(TRL_MICRO.get(shape, 4), seqs)), "--out", str(out), "--beta",
               "0.001" if LATHE_SETTINGS[shape]["kl"] else "0.0"]
        rc, wall = run_child(cmd, Path(args.logs) / f"trl-{shape}.log", args.timeout)
        trl = json.loads(out.read_text()) if out.exists() else {}
        timed = trl.get("step_s_all", [])[args.trl_warmup:]
        res["trl"] = {"command": " ".join(cmd[1:]), "returncode": rc, "wall_s": wall, **trl,
                      "step_s": statistics.median(timed) if timed else None}
    elif "trl" in args.systems:
        res["trl"] = {"skipped": args.trl_skip[shape]}
    lathe_s, trl_s = res.get("lathe", {}).get("step_s"), res.get("trl", {}).get("step_s")
    if lathe_s and trl_s:
        res["speedup_vs_trl"] = trl_s / lathe_s
    res["what"] = kept_going("summary", lambda: what(shape, res), lambda err: f"{shape}: no summary ({err})")
    return res


def kept_going(name: str, derive, fallback=lambda err: {"error": err}):
    """`derive()`, or where it raises (a bug in what this script derives from a finished run) `fallback(the error)`
    in its place, the error printed too, so that the run's measurements are still written."""
    try:
        return derive()
    except Exception as e:       # noqa: BLE001 - the measurement outlives a bug in what is computed from it
        print(f"e2e: the {name} failed ({type(e).__name__}: {e}); the measurements are written without it",
              file=sys.stderr)
        return fallback(f"{type(e).__name__}: {e}")


def speed_of_light(shape: str, row: dict, args, device: str | None = None) -> dict:
    """bench/roofline.py's bound per phase beside the phases measured in `row` (a `lathe_row`), on `device` (a
    device's name; default: args.device's)."""
    from lathe.config.schema_rollout import RolloutConfig
    command = row["command"].split()
    max_seqs = int(last_value(command, "actor_rollout_ref.rollout.max_num_seqs") or RolloutConfig().max_num_seqs)
    return step_light(SHAPES[shape], device or device_name(torch.device(args.device)), prompts=args.prompts, n=args.n,
                      prompt_len=args.prompt_len, response_len=args.response_len, measured=row.get("phases_s", {}),
                      step_s=row.get("step_s"), checkpointing=recomputed(shape, command), gpus=args.gpus,
                      max_num_seqs=max_seqs, teacher=SHAPES[args.teacher] if args.teacher else None,
                      grouped=prefix_grouped(command), shared_rows=shared_prompt_rows(shape, command, args))


def shared_prompt_rows(shape: str, command: list[str], args) -> int:
    """The rows that read a prompt's K/V once in the run's decode steps (lathe's shared-prefix decode attention, as
    the engine decides it: `lathe.engine.cuda_graph`), or 1 where they do not share: a prompt below the engine's
    threshold, the key or prefix caching off, an FP8 KV cache; and 1 for shapes with sliding-window or linear-
    attention layers, whose bound this does not split by layer (GPT-OSS's full layers do share: its bound keeps every
    row's reads, a little above the work)."""
    from lathe.engine.cuda_graph import prefix_group_rows, prefix_min_tokens
    cfg = SHAPES[shape]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    least = prefix_min_tokens(kv, cfg.get("head_dim") or cfg["hidden_size"] // heads)
    off = ((last_value(command, "actor_rollout_ref.rollout.shared_prefix_attention") or "true").lower() == "false"
           or (last_value(command, "actor_rollout_ref.rollout.enable_prefix_caching") or "true").lower() == "false"
           or (last_value(command, "actor_rollout_ref.rollout.kv_cache_dtype") or "auto").startswith("fp8")
           or "layer_types" in cfg)
    rows = min(prefix_group_rows(heads, kv), args.n)
    return 1 if off or args.prompt_len < least or rows < 2 else rows


def prefix_grouped(command: list[str]) -> bool:
    """Whether a lathe `command` runs the actor's passes prefix-grouped (`actor.use_prefix_grouper`)."""
    return (last_value(command, "actor_rollout_ref.actor.use_prefix_grouper") or "false").lower() == "true"


def last_value(command: list[str], key: str) -> str | None:
    """The value of the last `key=value` word of a lathe `command` (the last one wins, as in lathe's CLI), or None."""
    return next((w.split("=", 1)[1] for w in reversed(command) if w.startswith(f"{key}=")), None)


def recomputed(shape: str, command: list[str]) -> float:
    """The fraction of the decoder layers that a lathe run of `command` (its key=value words) recomputes: its last
    `enable_gradient_checkpointing` and `gradient_checkpointing_layers`. (The bound once read the shape's setting in
    LATHE_SETTINGS alone: a run that turned recomputation off by --extra got a bound that counted it.)"""
    model = "actor_rollout_ref.model."
    if (last_value(command, model + "enable_gradient_checkpointing") or "false").lower() != "true":
        return 0.0
    layers, total = last_value(command, model + "gradient_checkpointing_layers"), SHAPES[shape]["num_hidden_layers"]
    return 1.0 if layers in (None, "null") else min(int(layers), total) / total


def relight(path: Path, note: str) -> list[str]:
    """Re-derive the speed of light of each lathe row in the result file `path` from its own measured phases and
    workload (`speed_of_light` as this script now computes it) and write it back where it changed, keeping the old step
    fraction and `note` (why) beside it. Returns what changed, one line a row."""
    doc = json.loads(path.read_text())
    if "workload" not in doc or "models" not in doc:
        return []
    args = argparse.Namespace(**{"extra": [], "teacher": None, "gpus": 1, **doc["workload"]})
    changed = []
    for shape, m in doc["models"].items():
        row = m.get("lathe") if isinstance(m, dict) else None
        if not row or "step" not in row.get("speed_of_light", {}) or shape not in SHAPES \
                or ("teacher" in row.get("phases_s", {}) and not args.teacher):   # written before --teacher was kept
            continue
        new = speed_of_light(shape, row, args, device=doc["device"])
        old = row["speed_of_light"]
        if old["step"]["light_s"] is None or abs(new["step"]["light_s"] / old["step"]["light_s"] - 1) < 1e-3:
            continue
        row["speed_of_light"] = new
        row["speed_of_light_rederived"] = {"note": note, "step_fraction_as_written": old["step"]["fraction"],
                                           "step_light_s_as_written": old["step"]["light_s"]}
        m["what"] = what(shape, m)
        changed.append(f"{path.name} {shape}: step at {old['step']['fraction']:.1%} -> {new['step']['fraction']:.1%} "
                       "of its speed of light")
    if changed:
        path.write_text(json.dumps(doc, indent=2))
    return changed


def what(shape: str, res: dict) -> str:
    """One sentence: lathe's step time and its fraction of the speed of light, per phase."""
    la = res.get("lathe", {})
    if not la.get("step_s"):
        return f"{shape}: no lathe step timed"
    sol = la.get("speed_of_light", {})
    text = f"{shape}: `lathe train` GRPO {la['step_s']:.2f} s/step"
    if sol.get("step", {}).get("fraction") is None:
        return text + "; no speed-of-light figure on this device"
    parts = ", ".join(f"{p} {r['fraction']:.1%}" for p, r in sol.items() if p not in ("step", "rates")
                      and isinstance(r, dict) and r.get("fraction") is not None)   # not the flags (`grouped`)
    gen = sol.get("gen", {})
    touched = (f"; reading the experts its batch touches, gen {gen['touched_fraction']:.1%}, step "
               f"{sol['step']['touched_fraction']:.1%}" if gen.get("touched_light_s", 0) > gen.get("light_s", 0) else "")
    return (text + f", at {sol['step']['fraction']:.1%} of its speed of light (light {sol['step']['light_s']:.2f} s; "
            f"{parts}{touched})")


def print_table(results: dict) -> None:
    """SoL: the step's speed of light over its measured time."""
    print(f"\n{'model':<6} {'lathe s/step':>12} {'gen':>6} {'old_lp':>7} {'ref':>6} {'update':>7} {'MFU upd':>8} "
          f"{'SoL':>6} {'tok/s':>9} {'peak GiB':>9} {'TRL s/step':>11} {'speed-up':>9}")
    for shape, r in results["models"].items():
        la, tr = r.get("lathe", {}), r.get("trl", {})
        ph = la.get("phases_s", {})
        f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"   # noqa: E731
        print(f"{shape:<6} {f(la.get('step_s'), '12.2f')} {f(ph.get('gen'), '6.2f')} {f(ph.get('old_log_prob'), '7.2f')} "
              f"{f(ph.get('ref'), '6.2f')} {f(ph.get('update_actor'), '7.2f')} {f(la.get('update_mfu'), '8.1%')} "
              f"{f(la.get('speed_of_light', {}).get('step', {}).get('fraction'), '6.1%')} "
              f"{f(la.get('tokens_per_s'), '9.0f')} {f(la.get('max_memory_allocated_gb'), '9.1f')} "
              f"{f(tr.get('step_s'), '11.2f')} {f(r.get('speedup_vs_trl'), '8.2f')}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="0.5b,1.5b,7b")
    p.add_argument("--systems", default="lathe,trl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=1, help="lathe: trainer.n_gpus_per_node (more than 1: Ray workers, "
                                                       "FSDP2); the batch stays the same (strong scaling)")
    p.add_argument("--ray", action="store_true", help="lathe: LATHE_RAY=1, one GPU as a Ray worker group of one "
                                                      "FSDP2 rank (the distributed path's cost on one GPU)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="lathe steps per model")
    p.add_argument("--warmup", type=int, default=2, help="lathe steps left out of the median (compilation)")
    p.add_argument("--trl-steps", type=int, default=4)
    p.add_argument("--trl-warmup", type=int, default=1)
    p.add_argument("--trl-skip", default="7b", help="shapes TRL is not run on (comma list)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=default_workdir("lathe-e2e"))
    p.add_argument("--logs", default=None, help="child logs directory (default: <workdir>/logs)")
    p.add_argument("--git-sha", default=None,
                   help="the commit measured, as your checkout names it (the GPU copy of the tree may lack .git or "
                        "carry a stale one: do not compute it there)")
    p.add_argument("--teacher", default=None, metavar="SHAPE",
                   help="on-policy distillation from a random-weight teacher of this shape (written beside the model, "
                        "with the student's tokenizer): distillation.enabled=true and its model_path; the loss keys "
                        "through --extra; its forward reported as the phase `teacher`")
    p.add_argument("--extra", nargs="*", default=[], metavar="key=value",
                   help="lathe: more keys after the bench's own (e.g. actor_rollout_ref.model.lora_rank=64)")
    p.add_argument("--profile-step", type=int, default=0,
                   help="lathe: profile this step (global_profiler.tool=torch); its per-phase kernel summary goes "
                        "into the JSON and the step is left out of the median (the profiler slows it)")
    p.add_argument("--profile-stack", action="store_true",
                   help="with --profile-step: Python frames too (global_profiler.with_stack; bench/trace_phases.py "
                        "then names what the host does in the decode steps that fall behind)")
    p.add_argument("--out", default=None)
    p.add_argument("--relight", nargs="+", default=None, metavar="RESULT.json",
                   help="run nothing: re-derive the speed of light of these result files from their measured phases "
                        "(after a correction of the bound), with --relight-note saying why")
    p.add_argument("--relight-note", default="")
    args = p.parse_args()
    if args.relight:
        if not args.relight_note:
            p.error("--relight needs --relight-note: why the bound changed (it is written into each file)")
        for f in args.relight:
            print("\n".join(relight(Path(f), args.relight_note)) or f"{f}: unchanged")
        return
    args.systems = args.systems.split(",")
    args.trl_skip = {s: "not run: TRL keeps fp32 weights, gradients and AdamW state (about 16 bytes per parameter) "
                        "plus a reference copy, which does not fit one GPU at 7B"
                     for s in args.trl_skip.split(",") if s}
    args.logs = args.logs or str(Path(args.workdir) / "logs")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    name = device_name(device)
    out = Path(args.out or ROOT / "bench" / "results" / f"e2e_{slug(name)}.json")
    results = {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "git_sha": args.git_sha or git_sha(), "torch": torch.__version__, "command": " ".join(sys.argv),
               "workload": {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "response_len", "steps", "teacher",
                                                          "warmup", "trl_steps", "trl_warmup", "gpus", "ray", "extra",
                                                          "profile_step", "profile_stack")},
               "peak_bf16_tflops_datasheet": datasheet_peak(name), "models": {}}
    for shape in args.models.split(","):
        results["models"][shape] = bench_model(shape, args, datasheet_peak(name), device_rates(name)[0])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print_table(results)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
