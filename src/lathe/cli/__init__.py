"""The `lathe` command.

    lathe train [PRESET|FILE.yaml] [key=value ...] [--print-config]
    lathe sft [FILE.yaml] [key=value ...] [--print-config]
    lathe preprocess gsm8k|gsm8k_tool|math500|aime24|amc23|geo3k|geo3k_tool --input DIR_OR_FILE --output DIR
    lathe model check MODEL_DIR
    lathe generate MODEL_DIR INPUT.jsonl OUTPUT.jsonl [key=value ...]
    lathe presets
    lathe diagnose [--json] [--ray]
    lathe export RUN_DIR OUT_DIR [--step N] [--part actor|critic] [--check] [--force]
    lathe report RUN_DIR [-o OUT.html] [--val-dir DIR] [--rollout-dir DIR] [--max-samples N]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from lathe.cluster.placement import ClusterError

# Mistakes a user can make and fix (ConfigError, DataError, PreprocessError, ModelLoadError and the algorithm
# registry's errors are ValueErrors): shown as one plain message without a traceback, unless LATHE_DEBUG=1.
_USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError, NotImplementedError,
                                                 ClusterError)


def _split_source(items: list[str]) -> tuple[str | None, list[str]]:
    """`[PRESET|FILE] key=value ...` -> (source, overrides)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _demo_settings_on_a_users_model(overrides: list[str]) -> None:
    """`lathe train key=value ...` names no preset, so it starts from the built-in demo's (`default`); pointed at a
    model of the user's, the demo's supervised warm start (its learning rate meant for a random tiny model) would
    rewrite that model before RL, on the CPU. Refused unless the warm start is set explicitly; naming a preset
    (`base`: verl's defaults, `default`: the demo's, on purpose) says which is meant."""
    from lathe.config import ConfigError
    from lathe.config.loader import DEFAULT_PRESET, PRESET_DIR, _read_mapping
    given = dict(item.lstrip("+").partition("=")[::2] for item in overrides)
    path = given.get("actor_rollout_ref.model.path")
    if path is None or path.startswith("builtin:") or any(k.startswith("actor_rollout_ref.model.warm_start.steps")
                                                          for k in given):
        return
    demo = _read_mapping(PRESET_DIR / f"{DEFAULT_PRESET}.yaml")
    model, trainer = demo["actor_rollout_ref"]["model"], demo.get("trainer", {})
    warm, actor_lr = model["warm_start"], demo["actor_rollout_ref"]["actor"]["optim"]["lr"]
    raise ConfigError(
        f"actor_rollout_ref.model.path={path} with no preset named: `lathe train` then starts from the built-in "
        f"demo's settings (preset `{DEFAULT_PRESET}`: trainer.device={trainer.get('device')}, a supervised warm start "
        f"of {warm['steps']} steps at lr {warm['lr']:g} on extra_info.answer before RL, actor lr {actor_lr:g}), made "
        f"for its tiny random model, not yours. Fix: `lathe train base key=value ...` to start from verl's defaults "
        f"(what a verl launch line expects), or `lathe train {DEFAULT_PRESET} ...` to keep the demo's settings "
        f"(actor_rollout_ref.model.warm_start.steps=0 turns its warm start off)")


def cmd_train(args: argparse.Namespace) -> int:
    from lathe.config import ConfigError, load_config, to_yaml
    source, overrides = _split_source(args.items)
    found = []
    if source is None and not args.print_config:
        try:
            _demo_settings_on_a_users_model(overrides)
        except ConfigError as e:            # (reported with preflight's problems: every problem at once)
            found.append(e)
    cfg = load_config(source, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from lathe.loop.preflight import preflight
    checked = preflight(cfg, found=found)   # model paths, data, reward function: before torch is imported
    from lathe.loop.run import fit
    from lathe.loop.setup import build_trainer
    trainer = build_trainer(cfg, checked)
    try:
        metrics = fit(trainer)
    finally:
        trainer.close()
    score = metrics.get("critic/score/mean")
    logging.getLogger("lathe").info("done: %d steps, last critic/score/mean %s, run directory %s",
                                    trainer.global_step, "n/a" if score is None else f"{score:.3f}",
                                    cfg.trainer.default_local_dir)
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from lathe.config import to_yaml
    from lathe.config.sft import load_sft_config
    source, overrides = _split_source(args.items)
    cfg = load_sft_config(source, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from lathe.loop.preflight import preflight_sft
    preflight_sft(cfg)                      # model paths and data: before torch is imported
    from lathe.loop.sft import run_sft
    metrics = run_sft(cfg, checked=True)
    logging.getLogger("lathe").info("done: last train/loss %s, run directory %s",
                                    f"{metrics['train/loss']:.4f}" if "train/loss" in metrics else "n/a",
                                    cfg.trainer.default_local_dir)
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from lathe.data.preprocess import PREPROCESSORS
    if args.dataset not in PREPROCESSORS:
        raise ValueError(f"unknown dataset {args.dataset!r}; known: {', '.join(sorted(PREPROCESSORS))}")
    outputs = PREPROCESSORS[args.dataset](args.input, args.output)
    for split, path in outputs.items():
        print(f"{split}: {path}")
    return 0


def cmd_model_check(args: argparse.Namespace) -> int:
    from lathe.cli.model_check import run_check
    return run_check(args.model_dir, num_batches=args.batches, atol=args.atol)


def cmd_generate(args: argparse.Namespace) -> int:
    from lathe.cli.generate import generate_file
    generate_file(args.model_dir, args.input, args.output, args.items)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from lathe.cli.migrate import migrate
    return migrate(args.script)


def cmd_presets(args: argparse.Namespace) -> int:
    from lathe.config import describe_preset, list_presets
    names = list_presets()
    width = max(map(len, names))
    print("\n".join(f"{name:<{width}}  {describe_preset(name)}" for name in names))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from lathe.cli.diagnose import run
    return run(as_json=args.json, ray=args.ray)


def cmd_export(args: argparse.Namespace) -> int:
    from lathe.ckpt.export import check_loads, export
    out = export(args.source, args.out, step=args.step, part=args.part, force=args.force)
    print(f"exported {args.part} to {out}")
    if args.check:
        print(f"transformers loads it: {check_loads(out, args.part)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from lathe.report import write_report
    print(write_report(args.run_dir, args.out, val_dir=args.val_dir, rollout_dir=args.rollout_dir,
                       max_samples=args.max_samples))
    return 0


def _sampling_keys() -> str:
    """`lathe generate`'s sampling keys: `SamplingParams`' fields, declared once in `lathe.generation`."""
    from lathe.generation import SamplingParams
    return ", ".join(f.name for f in dataclasses.fields(SamplingParams))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lathe", description="RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run PPO/GRPO training (no arguments: the built-in CPU demo)")
    train.add_argument("items", nargs="*", metavar="[PRESET|FILE.yaml] key=value",
                       help="a preset name or YAML file, then verl-style key=value overrides")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=cmd_train)
    sft = sub.add_parser("sft", help="supervised fine-tuning with verl's SFT trainer keys (built-in task by default)")
    sft.add_argument("items", nargs="*", metavar="[FILE.yaml] key=value", help="a YAML file in verl's SFT layout "
                                                                              "and/or overrides")
    sft.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    sft.set_defaults(func=cmd_sft)
    pre = sub.add_parser("preprocess", help="turn a raw dataset into verl-schema parquet")
    pre.add_argument("dataset", help="gsm8k, gsm8k_tool (multi-turn with the calc_gsm8k_reward tool; alias "
                                      "gsm8k_multiturn_w_tool), math500, aime24, amc23, geo3k (images; a local copy of "
                                      "hiyouga/geometry3k) or geo3k_tool (geo3k, multi-turn with the calc_geo3k_reward "
                                      "tool; alias geo3k_multiturn_w_tool)")
    pre.add_argument("--input", required=True, help="the raw data: a directory, or a .jsonl file (a .parquet file "
                                                     "for geo3k and geo3k_tool)")
    pre.add_argument("--output", required=True, help="directory for train/test parquet files")
    pre.set_defaults(func=cmd_preprocess)
    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    check = model.add_parser("check", help="compare lathe's decoder with transformers on a checkpoint")
    check.add_argument("model_dir", help="a local Hugging Face checkpoint directory, or a lathe checkpoint "
                                         "(global_step_N: its actor; its files are verified first)")
    check.add_argument("--batches", type=int, default=3, help="ragged random batches to compare")
    check.add_argument("--atol", type=float, default=1e-4, help="largest logit difference accepted")
    check.set_defaults(func=cmd_model_check)
    gen = sub.add_parser("generate", help="offline batch generation with lathe's engine (JSON lines in and out)",
                         description="Generate for every row of INPUT.jsonl ({\"prompt\": text or chat messages} or "
                                     "{\"prompt_token_ids\": [...]}) and write one row per input row to OUTPUT.jsonl. "
                                     f"Sampling keys (vLLM's SamplingParams): {_sampling_keys()}. Engine keys: "
                                     "dtype, device, gpu_memory_utilization, max_num_seqs, max_model_len, "
                                     "enable_prefix_caching, batch_size. Tools (the "
                                     "multi-turn loop of lathe train): tool_config_path (verl's tool YAML) turns it "
                                     "on; then tool_format, max_assistant_turns, max_user_turns, max_parallel_calls, "
                                     "max_tool_response_length, tool_response_truncate_side, tool_timeout.")
    gen.add_argument("model_dir", help="a local Hugging Face checkpoint directory (with its tokenizer)")
    gen.add_argument("input", help="JSON lines, one prompt per row")
    gen.add_argument("output", help="JSON lines written here, one row per input row, in input order")
    gen.add_argument("items", nargs="*", metavar="key=value", help="sampling and engine settings")
    gen.set_defaults(func=cmd_generate)
    mig = sub.add_parser("migrate", help="read a verl launch script: what lathe does with each key, and the "
                                         "lathe train command (exit 1 if a key is refused)")
    mig.add_argument("script", metavar="SCRIPT.sh", help="a verl launch script (read, never run; its variables "
                                                         "come from the script and the environment)")
    mig.set_defaults(func=cmd_migrate)
    presets = sub.add_parser("presets", help="list the built-in config presets")
    presets.set_defaults(func=cmd_presets)
    diag = sub.add_parser("diagnose", help="check this machine for lathe: versions, GPUs, driver, NCCL, "
                                           "environment variables; exit 1 on a problem")
    diag.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    diag.add_argument("--ray", action="store_true", help="also join the Ray cluster (RAY_ADDRESS or the local one) "
                                                         "and list its resources")
    diag.set_defaults(func=cmd_diagnose)
    exp = sub.add_parser("export", help="a checkpoint as a plain Hugging Face directory (verl's model_merger)")
    exp.add_argument("source", help="a run directory (its latest checkpoint) or one of its global_step_<k>")
    exp.add_argument("out", help="the directory to write (config, safetensors, tokenizer)")
    exp.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the latest)")
    exp.add_argument("--part", default="actor", help="actor (default) or critic")
    exp.add_argument("--check", action="store_true", help="then load it with transformers and run a forward")
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    exp.set_defaults(func=cmd_export)
    rep = sub.add_parser("report", help="a run directory as one self-contained HTML page: charts, config, samples")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (trainer.default_local_dir)")
    rep.add_argument("-o", "--out", metavar="OUT.html", help="the file to write (default: RUN_DIR/report.html)")
    rep.add_argument("--val-dir", metavar="DIR", help="validation samples, <step>.jsonl files "
                                                      "(default: the saved config's trainer.validation_data_dir)")
    rep.add_argument("--rollout-dir", metavar="DIR", help="training samples, <step>.jsonl files "
                                                          "(default: the saved config's trainer.rollout_data_dir)")
    rep.add_argument("--max-samples", metavar="N", type=int, default=4, help="samples per step file (default 4)")
    rep.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from lathe.cli.output import setup_output
    setup_output()
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command in ("train", "sft") and not any(r.startswith("-") for r in rest):
        args.items += rest              # `lathe train PRESET --print-config key=value`: keys after the flag too
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("lathe: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as e:
        if os.environ.get("LATHE_DEBUG"):
            raise
        print(f"lathe: error: {e}", file=sys.stderr)
        print("lathe: (set LATHE_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
