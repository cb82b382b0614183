"""`lathe sft`'s config: verl's SFT trainer keys (``sft_trainer.yaml`` and the newer ``sft_trainer_engine.yaml``).

Both of verl's shapes are accepted: single-turn rows (``data.prompt_key`` / ``data.response_key``, with
``*_dict_keys`` for a struct column) and multi-turn rows (a ``messages`` list; verl's older
``data.multiturn.messages_key`` or its newer ``data.messages_key``). The model is ``model.path`` (verl's
older spelling ``model.partial_pretrain`` is accepted). The defaults train lathe's built-in tiny model on the
built-in arithmetic answers, on a CPU in seconds, so that ``lathe sft`` runs with no download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .choices import CheckpointPart, Strategy
from .coerce import spec
from .schema import Logger, PathNameConfig
from .schema_actor import RECOMPUTE_LAYERS_HELP, FSDPConfig, OptimConfig


@dataclass
class MultiturnConfig:
    """verl's older ``data.multiturn`` group."""

    enable: bool = spec(False, "Rows are conversations (the messages column); false = decided by the columns.")
    messages_key: str | None = spec(None, "Column of the conversation; null = data.messages_key.")
    tools_key: str | None = spec(None, "Column of the tool schemas; null = data.tools_key.")
    enable_thinking_key: str | None = spec(None, "Column of a per-row enable_thinking; null = data.enable_thinking_key.")


@dataclass
class SFTDataConfig:
    """What to train on and how it is batched (verl ``data`` of the SFT trainer)."""

    train_files: str | list[str] = spec("builtin:arithmetic", "Training file(s): parquet, jsonl or json; "
                                                              "'builtin:arithmetic' = the built-in task.")
    val_files: str | list[str] | None = spec("builtin:arithmetic", "Validation file(s) (val/loss); null = none.")
    train_max_samples: int = spec(-1, "Use at most this many training rows; -1 = all.")
    val_max_samples: int = spec(-1, "Use at most this many validation rows; -1 = all.")
    train_batch_size: int = spec(64, "Sequences per optimizer step (all devices together).")
    micro_batch_size_per_gpu: int = spec(4, "Sequences per forward/backward on each device (and per validation "
                                            "forward); ignored with use_dynamic_bsz.")
    micro_batch_size: int | None = spec(None, "Deprecated (verl): global micro-batch; divided by the devices.")
    use_dynamic_bsz: bool = spec(False, "Pack micro-batches by real tokens (max_token_len_per_gpu) instead of a fixed "
                                        "number of sequences.")
    max_token_len_per_gpu: int = spec(8192, "Token budget of a micro-batch with use_dynamic_bsz.")
    prompt_key: str = spec("prompt", "Single-turn: column of the prompt (a string, a chat message list, or a "
                                     "struct read through prompt_dict_keys).")
    response_key: str = spec("extra_info", "Single-turn: column of the response (string or struct).")
    prompt_dict_keys: list[str] | None = spec(None, "Path into a struct prompt column, e.g. [question].")
    response_dict_keys: list[str] | None = spec(["answer"], "Path into a struct response column, e.g. [answer].")
    messages_key: str = spec("messages", "Multi-turn: column of the conversation (a list of {role, content}); "
                                         "the loss covers the assistant turns only.")
    tools_key: str = spec("tools", "Multi-turn: column of tool schemas passed to the chat template.")
    enable_thinking_key: str = spec("enable_thinking", "Multi-turn: column of a per-row enable_thinking flag.")
    enable_thinking_default: bool | str | None = spec(None, "enable_thinking when a row has none; null/none = the "
                                                            "template's default.")
    multiturn: MultiturnConfig = spec(factory=MultiturnConfig, help="verl's older multi-turn switches.")
    max_length: int = spec(1024, "Tokens per example (prompt + response, after the chat template).")
    truncation: Literal["error", "left", "right"] = spec("error", "An example longer than max_length: error | "
                                                                  "left (keep the end) | right (keep the start).")
    pad_mode: Literal["no_padding", "right"] = spec("no_padding", "verl's batch layout; lathe's decoder runs packed "
                                                                  "either way (the loss is the same).")
    balance_dp_token: bool = spec(False, "verl: balance tokens across data-parallel ranks (see "
                                         "trainer.balance_batch).")
    chat_template: str | None = spec(None, "Jinja chat template replacing the tokenizer's.")
    custom_cls: PathNameConfig = spec(factory=PathNameConfig, help="Custom dataset class (verl).")
    use_shm: bool = spec(False, "Copy the files to shared memory first (verl).")
    apply_chat_template_kwargs: dict[str, Any] = spec({}, "Extra kwargs for tokenizer.apply_chat_template.")
    num_workers: int = spec(8, "Data loader worker processes (verl; lathe tokenizes up front).")
    ignore_input_ids_mismatch: bool = spec(False, "A conversation whose turns, rendered one by one, do not add up to "
                                                  "the whole rendering: train on the turn-by-turn tokens (true) or "
                                                  "stop with the row named (false).")
    shuffle: bool = spec(True, "Shuffle the training set each epoch.")
    seed: int | None = spec(None, "Shuffle seed; null = trainer.seed.")


@dataclass
class SFTModelConfig:
    """The model trained (verl ``model`` of the SFT trainer)."""

    path: str = spec("builtin:tiny", "HF model dir or id; 'builtin:tiny' = a tiny model built in code.")
    partial_pretrain: str | None = spec(None, "verl's older spelling of path; when set it wins.")
    tokenizer_path: str | None = spec(None, "Tokenizer location; null = path.")
    trust_remote_code: bool = spec(False, "Allow model code shipped with the checkpoint.")
    external_lib: str | None = spec(None, "Python module imported before loading (registers custom models).")
    override_config: dict[str, Any] = spec({}, "Keys that override the model's HF config.")
    impl: Literal["auto", "lathe", "hf"] = spec("auto", "lathe: auto = lathe's decoder for Llama/Qwen2/Qwen3 (packed "
                                                        "forward), transformers otherwise.")
    enable_gradient_checkpointing: bool = spec(True, "Recompute each decoder layer in backward (lathe's decoder).")
    gradient_checkpointing_layers: int | None = spec(None, RECOMPUTE_LAYERS_HELP)
    use_remove_padding: bool | None = spec(None, "Packed forward (lathe's decoder always packs in SFT).")
    use_shm: bool = spec(False, "Copy the model to shared memory first (verl).")
    fsdp_config: FSDPConfig = spec(factory=FSDPConfig, help="Precision, sharding and offload.")
    strategy: Strategy = spec("fsdp2", "Training backend (verl: fsdp|fsdp2|megatron).")
    lora_rank: int = spec(0, "LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = spec(16, "LoRA alpha.")
    target_modules: str | list[str] = spec("all-linear", "LoRA target modules.")
    use_liger: bool = spec(False, "Liger kernels (verl).")


@dataclass
class SFTOptimConfig(OptimConfig):
    """verl's SFT ``optim`` (its defaults: lr 1e-5, betas (0.9, 0.95), 10% warm-up, cosine, clip 1.0)."""

    warmup_steps_ratio: float | None = spec(None, "verl's older name for lr_warmup_steps_ratio; when set it wins.")
    lr_scheduler: Literal["constant", "cosine"] | None = spec(None, "verl's older name for lr_scheduler_type; "
                                                                    "when set it wins.")


def _sft_optim() -> SFTOptimConfig:
    return SFTOptimConfig(lr=1e-5, betas=[0.9, 0.95], weight_decay=0.01, lr_warmup_steps_ratio=0.1,
                          lr_scheduler_type="cosine", clip_grad=1.0)


@dataclass
class SFTTrainerConfig:
    """Run length, logging, checkpoints and placement (verl ``trainer`` of the SFT trainer)."""

    default_local_dir: str = spec("checkpoints/${trainer.project_name}/${trainer.experiment_name}",
                                  "Run directory: checkpoints and metrics.")
    default_hdfs_dir: str | None = spec(None, "Copy checkpoints to this HDFS directory (verl).")
    project_name: str = spec("lathe-sft", "Project (logger group, checkpoint dir).")
    experiment_name: str = spec("default", "Run name within the project.")
    total_epochs: int = spec(4, "Passes over the training set.")
    total_training_steps: int | None = spec(None, "Stop after this many steps; null = total_epochs.")
    logger: list[Logger] = spec(["console"], "Loggers; metrics.jsonl is always written.", scalar_to_list=True)
    seed: int = spec(1, "Seeds python, numpy and torch.")
    save_freq: int | Literal["after_each_epoch"] = spec(-1, "Save a checkpoint every N steps (and at the last); -1 = "
                                                            "only at the last step; after_each_epoch = every epoch's "
                                                            "steps (verl's sft_trainer).")
    test_freq: int | Literal["after_each_epoch"] = spec(-1, "Validation loss every N steps (and at the last); -1 = "
                                                            "only at the last step; after_each_epoch = every epoch's "
                                                            "steps (verl's sft_trainer).")
    nnodes: int = spec(1, "Nodes.")
    n_gpus_per_node: int = spec(1, "Devices per node; more than one device in all runs Ray workers with FSDP2.")
    max_ckpt_to_keep: int | None = spec(None, "Keep only the newest N checkpoints; null = all.")
    balance_batch: bool = spec(True, "Deal sequences to data-parallel ranks by token count.")
    resume_mode: Literal["auto", "disable", "resume_path"] = spec(
        "auto", "auto = resume from the latest checkpoint in default_local_dir if any.")
    resume_from_path: str | None = spec(None, "Checkpoint dir used when resume_mode=resume_path.")
    resume_fallback_to_verified: bool = spec(
        False, "lathe: with resume_mode=auto, when the latest checkpoint does not match its manifest (a file missing, "
               "truncated or changed), resume from the newest earlier checkpoint that does, with a warning; false = "
               "stop with an error naming both.")
    device: Literal["auto", "cpu", "cuda"] = spec("auto", "auto = cuda when available, else cpu.")
    use_sudo_for_checkpoint: bool = spec(False, "verl: write checkpoints with sudo.")
    checkpoint: dict[str, Any] = spec({}, "verl's older place of the checkpoint group (see checkpoint).")
    profile_interval: list[int] = spec([-1, -1], "verl: steps to profile.")


@dataclass
class SFTCheckpointConfig:
    """What a checkpoint holds (verl ``checkpoint``); lathe always saves the model (Hugging Face format),
    optimizer and the rest that an exact resume needs."""

    save_contents: list[CheckpointPart] = spec(["model", "optimizer", "extra"], "Parts to save (lathe saves them all).")
    load_contents: list[CheckpointPart] = spec(["model", "optimizer", "extra"], "Parts to load on resume.")


@dataclass
class SFTConfig:
    """The whole SFT run."""

    data: SFTDataConfig = spec(factory=SFTDataConfig, help="Data and batches.")
    model: SFTModelConfig = spec(factory=SFTModelConfig, help="The model.")
    optim: SFTOptimConfig = spec(factory=_sft_optim, help="AdamW and the learning-rate schedule.")
    trainer: SFTTrainerConfig = spec(factory=SFTTrainerConfig, help="Run control.")
    checkpoint: SFTCheckpointConfig = spec(factory=SFTCheckpointConfig, help="Checkpoint contents.")
    ulysses_sequence_parallel_size: int = spec(1, "Sequence-parallel degree (verl).")
    use_remove_padding: bool | None = spec(None, "verl's older place of model.use_remove_padding.")
    ray_kwargs: dict[str, Any] = spec({}, "Ray settings (e.g. ray_init.num_cpus) for many devices.")
    ray_init: dict[str, Any] = spec({}, "verl's older place of ray_kwargs.ray_init.")
