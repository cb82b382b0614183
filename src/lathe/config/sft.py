"""``load_sft_config``: defaults -> YAML file -> overrides -> interpolation -> verl's old spellings -> checks.

Every key of ``schema_sft`` acts, or is in ``entries()``: refused when set to a value lathe does not implement
(sequence parallelism, Liger, a custom dataset class, HDFS copies, ...), or warned about when it has no effect
(the registry's ``Entry`` of ``support_base``, as ``lathe train``'s keys are judged).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError, ProblemList
from .interpolate import resolve_interpolations
from .loader import _apply_overrides, _read_mapping
from .schema_sft import SFTConfig
from .sft_engine import newer_trainer_layers, split_selections, translate_engine
from .plan import Devices, MeshPlan, mesh_plan, trainer_devices
from .rules_optim import check_optimizer_group, fill_schedule
from .rules_recompute import recompute_problems
from .support_base import Entry, at_most, inert, one_of, only_on, refuse, warn
from .tree import Assignment, apply_layer, flatten_mapping, get_path

F = "model.fsdp_config"
ALWAYS_SAVED = {"model", "optimizer", "extra"}


def entries() -> list[Entry]:
    """The SFT keys lathe accepts but does not act on (fully): refused, or warned about (see support_base)."""
    return [
        refuse("ulysses_sequence_parallel_size", "Ulysses sequence parallelism in lathe sft (lathe train's actor, "
               "reference and critic have it)", "set it to 1", at_most(1)),
        refuse(f"{F}.tensor_parallel_size", "tensor parallelism in lathe sft (lathe train's actor, reference and "
               "critic have it)", "set it to 1", at_most(1)),
        refuse(f"{F}.expert_parallel_size", "expert parallelism in lathe sft (lathe train's actor, reference and "
               "critic have it)", "set it to 1", at_most(1)),
        refuse("model.use_liger", "Liger kernels"),
        refuse("data.custom_cls.path", "a custom dataset class"),
        refuse("trainer.default_hdfs_dir", "copying checkpoints to HDFS"),
        refuse("trainer.use_sudo_for_checkpoint", "writing checkpoints with sudo"),
        refuse("model.strategy", "a training backend other than fsdp/fsdp2", "set it to fsdp2",
               one_of("fsdp", "fsdp2")),
        inert(f"{F}.strategy", "fsdp and fsdp2 both train with PyTorch FSDP2"),
        refuse(f"{F}.grad_offload", "gradient offload (an old verl key)"),
        only_on("one device", refuse(f"{F}.offload_policy", "FSDP2's CPU offload policy on one device",
                                     "remove it; param_offload and optimizer_offload are the switches on one device")),
        only_on("one device", warn(f"{F}.reshard_after_forward", "a sharding setting, with nothing to shard")),
        *(warn(f"{F}.{k}", why) for k, why in (
            ("forward_prefetch", "FSDP2 prefetches the next layer's gather by itself"),
            ("use_orig_params", "an FSDP1 setting; FSDP2 always keeps the original parameters"),
            ("wrap_policy", "lathe shards each decoder layer and the root, whatever the policy"))),
        warn("optim.total_training_steps", "it is set at run time from trainer.total_training_steps (or the epochs)"),
        refuse("checkpoint.load_contents", "loading only part of a checkpoint",
               "remove it: lathe resumes model, optimizer and extra", lambda v, cfg: ALWAYS_SAVED <= set(v)),
        warn("checkpoint.save_contents", "lathe always saves model (in Hugging Face format), optimizer and extra",
             lambda v, cfg: set(v) - {"hf_model"} == ALWAYS_SAVED),
        warn("trainer.checkpoint", "lathe always saves model (in Hugging Face format), optimizer and extra",
             ok=lambda v, cfg: not v),
        warn("data.use_shm", "lathe reads the files once, up front"),
        warn("model.use_shm", "lathe reads the weights once, up front"),
        warn("data.num_workers", "lathe tokenizes the data once, up front"),
        warn("data.balance_dp_token", "lathe balances ranks by tokens with trainer.balance_batch"),
        warn("trainer.profile_interval", "lathe has no SFT profiler hook yet"),
        only_on("one device", warn("trainer.balance_batch", "it balances tokens across devices; there is one")),
    ]


def load_sft_config(source: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> SFTConfig:
    """The SFT config from the defaults, an optional YAML file (a partial tree) and ``key=value`` overrides.
    Raises ConfigError listing every problem."""
    cfg = SFTConfig()
    problems = ProblemList()
    chosen, overrides = split_selections(list(overrides))
    overrides, notes = translate_engine(overrides, problems)
    if chosen:                   # a script for verl's newer SFT trainer: its defaults (lathe.config.sft_engine)
        apply_layer(cfg, [Assignment(k, v, None, k, "verl's sft_trainer defaults")
                          for k, v in newer_trainer_layers(chosen).items()], context="")
    if source is not None:
        path = Path(os.path.expanduser(str(source)))
        if not path.is_file():
            raise ConfigError(f"lathe sft: config file '{source}' does not exist. Fix: pass the path to a .yaml file "
                              "in verl's SFT trainer layout (data:, model:, optim:, trainer:), or only key=value "
                              "overrides.")
        apply_layer(cfg, flatten_mapping(_read_mapping(path), f"in file {path}", SFTConfig),
                    context=f"Config file {path}: ")
    try:
        _apply_overrides(cfg, overrides)
    except ConfigError as err:
        problems.add(str(err))
    problems.raise_if_any()
    resolve_interpolations(cfg)
    _fill(cfg)
    if chosen.get("optim") == "megatron" and cfg.optim.optimizer == "adam":
        cfg.optim.optimizer = "AdamW"      # Megatron's adam decays the weights decoupled (as lathe train's fill)
    _check(cfg, notes)
    return cfg



def sft_mesh(cfg: SFTConfig) -> MeshPlan:
    """The mesh `lathe sft` shards its model on: `model.fsdp_config.fsdp_size` over the trainer's devices (plain
    FSDP, or HSDP when smaller; see `lathe.config.plan.mesh_plan`)."""
    t = cfg.trainer
    count = trainer_devices(cfg)
    why = f"{count} = trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}"
    return mesh_plan(cfg.model.fsdp_config.fsdp_size, Devices(count, why), f"{F}.fsdp_size")


def _fill(cfg: SFTConfig) -> None:
    """verl's older spellings onto the keys lathe reads."""
    d, m, o = cfg.data, cfg.model, cfg.optim
    if m.partial_pretrain:
        m.path = m.partial_pretrain
    for old in ("messages_key", "tools_key", "enable_thinking_key"):
        if getattr(d.multiturn, old):
            setattr(d, old, getattr(d.multiturn, old))
    if o.warmup_steps_ratio is not None:
        o.lr_warmup_steps_ratio = o.warmup_steps_ratio
    if o.lr_scheduler is not None:
        o.lr_scheduler_type = o.lr_scheduler
    fill_schedule(o)
    if cfg.use_remove_padding is not None and m.use_remove_padding is None:
        m.use_remove_padding = cfg.use_remove_padding
    devices = trainer_devices(cfg)
    if d.micro_batch_size is not None:
        d.micro_batch_size_per_gpu = max(1, d.micro_batch_size // max(1, devices))
    if d.seed is None:
        d.seed = cfg.trainer.seed


def _check(cfg: SFTConfig, notes: Sequence[str] = ()) -> None:
    problems, ignored, defaults = ProblemList(), list(notes), SFTConfig()
    for entry in entries():
        verdict = entry.verdict(get_path(cfg, entry.key), get_path(defaults, entry.key), cfg)
        if verdict is not None:
            (problems.add if verdict[0] == "refuse" else ignored.append)(verdict[1])
    if ignored:
        warnings.warn("lathe sft: config keys set here that have no effect:\n" + "\n".join(f"  - {m}" for m in ignored),
                      stacklevel=3)
    d, t = cfg.data, cfg.trainer
    devices = trainer_devices(cfg)
    for key, value in (("data.train_batch_size", d.train_batch_size), ("data.micro_batch_size_per_gpu",
                       d.micro_batch_size_per_gpu), ("data.max_length", d.max_length),
                       ("data.max_token_len_per_gpu", d.max_token_len_per_gpu), ("trainer.total_epochs",
                       t.total_epochs), ("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node)):
        if value < 1:
            problems.add(f"{key}={value}: it must be >= 1.")
    if devices >= 1:
        try:
            sft_mesh(cfg)
        except ConfigError as e:
            problems.add(str(e))
    if devices >= 1 and d.train_batch_size % devices:
        problems.add(f"data.train_batch_size={d.train_batch_size} is not divisible by the {devices} devices "
                     "(trainer.nnodes x trainer.n_gpus_per_node). Fix: make it a multiple of the devices.")
    if t.total_training_steps is not None and t.total_training_steps < 1:
        problems.add(f"trainer.total_training_steps={t.total_training_steps}: it must be >= 1 (or null).")
    if d.use_dynamic_bsz and d.max_token_len_per_gpu < d.max_length:
        problems.add(f"data.max_token_len_per_gpu={d.max_token_len_per_gpu} is below data.max_length="
                     f"{d.max_length}: a long example would not fit a micro-batch. Fix: raise max_token_len_per_gpu "
                     "to at least max_length.")
    check_optimizer_group(cfg.optim, "optim", problems)
    for message in recompute_problems(cfg.model, "model", cfg.model.impl, "model.impl"):
        problems.add(message)
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        problems.add("trainer.resume_mode=resume_path needs trainer.resume_from_path (a .../global_step_N directory).")
    problems.raise_if_any()
