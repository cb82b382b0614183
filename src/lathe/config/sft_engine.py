"""verl's newer SFT trainer (`verl.trainer.sft_trainer`, its `sft_trainer_engine.yaml`) in `lathe sft`.

lathe sft's own defaults are those of verl's older trainer (`fsdp_sft_trainer`, `sft_trainer.yaml`). A launch script
written for the newer one names its Hydra config groups (`engine=fsdp`, `optim=fsdp`, `model=hf_model`): such a
selection runs the script on that trainer's defaults, which differ (`NEWER_DEFAULTS`: a batch of 256 packed by
tokens, no validation file, and the chosen optimizer group's, `OPTIM_GROUPS`: lr 1e-3, constant, no warm-up, betas
(0.9, 0.999); not its logger, console and wandb: lathe logs what trainer.logger names), and reads the fsdp engine's
keys (`engine.*`, `ENGINE_KEYS`) as the keys of lathe sft that do the same. The other engines (megatron, veomni,
torchtitan, automodel, Megatron Lite) are refused by name: lathe train translates their keys onto FSDP2, lathe sft
does not yet.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

SELECTIONS = ("engine", "optim", "model", "profiler")
CHOICES = {"engine": ("fsdp",), "optim": ("fsdp", "megatron"), "model": ("hf_model",), "profiler": ("profiler",)}

# sft_trainer_engine.yaml where it differs from the older trainer's defaults, which lathe sft keeps otherwise
NEWER_DEFAULTS = {"data.train_batch_size": 256, "data.use_dynamic_bsz": True, "data.val_files": None}
# verl's optim/fsdp.yaml and optim/megatron.yaml (Megatron's adam decays the weights decoupled: AdamW)
_OPTIM_SHARED = {"optim.lr": 1e-3, "optim.betas": [0.9, 0.999], "optim.weight_decay": 0.01, "optim.clip_grad": 1.0,
                 "optim.lr_warmup_steps": -1, "optim.lr_warmup_steps_ratio": 0.0, "optim.min_lr_ratio": 0.0,
                 "optim.lr_warmup_init": 0.0, "optim.min_lr": 0.0}
OPTIM_GROUPS = {"fsdp": {**_OPTIM_SHARED, "optim.lr_scheduler_type": "constant"},
                "megatron": {**_OPTIM_SHARED, "optim.lr_scheduler_type": "constant",
                             "optim.lr_decay_style": "constant"}}

F = "model.fsdp_config"
# the fsdp engine's keys (engine/fsdp.yaml) -> lathe sft's key that does the same; None: nothing to do in lathe sft
# (how the log-prob's entropy is chunked: SFT computes none; padding to a length: the same math; the engine's
# seed: lathe seeds from trainer.seed)
ENGINE_KEYS: dict[str, str | None] = {
    "ulysses_sequence_parallel_size": "ulysses_sequence_parallel_size",
    **{k: f"{F}.{k}" for k in ("strategy", "fsdp_size", "param_offload", "optimizer_offload", "offload_policy",
                               "reshard_after_forward", "forward_prefetch", "model_dtype", "use_orig_params",
                               "use_torch_compile", "wrap_policy.min_num_params")},
    "dtype": f"{F}.mixed_precision.param_dtype",
    **dict.fromkeys(("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size", "entropy_checkpointing",
                     "pad_to_length", "pad_to_length_bucket", "forward_only"), None),
}
# engine keys with no equivalent: (kind, why, verl's default) for a key or a pattern (the first that matches)
ENGINE_UNREAD = {"seed": ("warn", "lathe sft seeds everything from trainer.seed", 42),
                 "full_determinism": ("warn", "lathe does not switch torch to deterministic algorithms", False),
                 "qat.enable": ("refuse", "quantization-aware training (QAT; lathe issue 48)", False),
                 "qat.*": ("warn", "it is read only with engine.qat.enable=true (refused)", None),
                 "turbo_config.*": ("warn", "the fsdp_turbo engine's layout; lathe sft runs FSDP2", None)}


def _same(value: str, default: Any) -> bool:
    return default is not None and str(value).strip().lower() == str(default).lower()


def split_selections(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """({group: choice} of the Hydra config-group selections among `overrides`, the other overrides)."""
    chosen, rest = {}, []
    for text in overrides:
        key, sep, value = text.lstrip("+").partition("=")
        if sep and key in SELECTIONS:
            chosen[key] = value
        else:
            rest.append(text)
    return chosen, rest


def newer_trainer_layers(chosen: dict[str, str]) -> dict[str, Any]:
    """The defaults a script for verl's newer SFT trainer runs on, for its group selections. Raises ConfigError
    naming a choice lathe sft cannot run."""
    bad = [f"{g}={c}" for g, c in chosen.items() if c not in CHOICES[g]]
    if bad:
        raise ConfigError(
            f"{', '.join(bad)}: verl's SFT trainer with "
            f"{'that config group' if len(bad) == 1 else 'those config groups'} is not implemented yet in lathe sft, "
            "which runs on FSDP2 (lathe train translates Megatron's, VeOmni's and torchtitan's keys onto FSDP2; "
            "lathe sft does not yet). Fix: choose engine=fsdp, optim=fsdp or optim=megatron, and set the model's "
            "sharding and offload in engine.* (verl's fsdp engine keys), or in model.fsdp_config.*.")
    return {**NEWER_DEFAULTS, **OPTIM_GROUPS[chosen.get("optim", "fsdp")]}


def translate_engine(overrides: list[str], problems) -> tuple[list[str], list[str]]:
    """`overrides` with verl's fsdp engine keys (`engine.*`) as lathe sft's, and the notes of keys that have no
    effect; a refused one goes to `problems`."""
    out, notes = [], []
    for text in overrides:
        key, sep, value = text.lstrip("+").partition("=")
        if not (sep and key.startswith("engine.")):
            out.append(text)
            continue
        leaf = key[len("engine."):]
        if leaf in ENGINE_KEYS:
            if ENGINE_KEYS[leaf] is not None:
                out.append(f"{ENGINE_KEYS[leaf]}={value}")
            continue
        pattern = next((p for p in ENGINE_UNREAD if p == leaf or p.endswith("*") and leaf.startswith(p[:-1])), None)
        if pattern is None:
            problems.add(f"Unknown config key `{key}` (override '{text}'): not a key of verl's fsdp engine "
                         f"(engine/fsdp.yaml). Fix: remove it, or name one of: "
                         f"{', '.join(sorted([*ENGINE_KEYS, *ENGINE_UNREAD]))}.")
            continue
        kind, why, default = ENGINE_UNREAD[pattern]
        if _same(value, default):
            continue
        if kind == "refuse":
            problems.add(f"`{key}`={value}: {why} is not implemented yet in lathe sft. Fix: remove it.")
        else:
            notes.append(f"`{key}`={value} has no effect in lathe sft: {why}.")
    return out, notes
