"""The root config tree ``LatheConfig`` and its data, critic, reward, algorithm and trainer groups.

Group and key names are verl's (``data.train_batch_size``, ``algorithm.adv_estimator``, ...), so a
verl launch script's ``key=value`` arguments apply unchanged. lathe-only keys say "lathe:".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .choices import (BypassLoss, ISLevel, KLControllerType, KLEstimator, LegacyWorkerImpl, LossAggMode,
                      ModelEngine, ProfilerTool, ReweightMethod, Strategy)
from .coerce import spec
from .schema_actor import RECOMPUTE_LAYERS_HELP, CheckpointConfig, FSDPConfig, OptimConfig
from .schema_async import AsyncTrainingConfig, RolloutPoolConfig
from .schema_distill import DistillationConfig
from .schema_judge import JudgeConfig, JudgeRolloutConfig
from .schema_rollout import ActorRolloutRefConfig
from .schema_v1 import TrainerV1Config


@dataclass
class PathNameConfig:
    """A Python object located by file path and attribute name."""

    path: str | None = spec(None, "Python file (or module) defining the object.")
    name: str | None = spec(None, "Name of the object in that file.")


@dataclass
class SamplerConfig:
    """verl ``data.sampler``: a custom (curriculum) sampler class."""

    class_path: str | None = spec(None, "Module containing the sampler class.")
    class_name: str | None = spec(None, "Sampler class name.")


@dataclass
class DataConfig:
    """Datasets and batch size (verl ``data``). Files are parquet/jsonl in verl's schema."""

    tokenizer: str | None = spec(None, "Tokenizer location; null = the model's.")
    use_shm: bool = spec(False, "Copy the files to shared memory first (verl).")
    train_files: str | list[str] = spec("builtin:arithmetic", "Training file(s); 'builtin:<task>' = built-in data.")
    val_files: str | list[str] | None = spec("builtin:arithmetic", "Validation file(s); null = no validation set.")
    train_max_samples: int = spec(-1, "Use at most this many training rows; -1 = all.")
    val_max_samples: int = spec(-1, "Use at most this many validation rows; -1 = all.")
    prompt_key: str = spec("prompt", "Column holding the chat-format prompt.")
    reward_fn_key: str = spec("data_source", "Column whose value the reward function gets as data_source (the "
                                             "built-in scorers pick their rule by it).")
    max_prompt_length: int = spec(512, "Prompt token budget (see truncation).")
    max_response_length: int = spec(512, "Max generated tokens per response.")
    train_batch_size: int = spec(1024, "Prompts per training step (each sampled rollout.n times).")
    val_batch_size: int | None = spec(None, "Prompts per validation batch; null = whole set (verl: deprecated).")
    gen_batch_size: int | None = spec(None, "DAPO: prompts generated per try when filtering groups; "
                                            "null = train_batch_size.")
    return_raw_input_ids: bool = spec(False, "Also return un-templated input ids (RM with another tokenizer).")
    return_raw_chat: bool = spec(False, "Also return the raw chat messages.")
    return_full_prompt: bool = spec(False, "Also return the templated prompt text.")
    shuffle: bool = spec(True, "Shuffle the training set each epoch.")
    seed: int | None = spec(None, "Shuffle seed; null = trainer.seed.")
    validation_shuffle: bool = spec(False, "Shuffle the validation set.")
    dataloader_num_workers: int = spec(8, "Data loader worker processes.")
    filter_overlong_prompts: bool = spec(False, "Drop rows whose templated prompt exceeds max_prompt_length.")
    filter_overlong_prompts_workers: int = spec(1, "Processes used for that filtering.")
    truncation: Literal["error", "left", "right", "middle"] = spec(
        "error", "What to do with a prompt longer than max_prompt_length.")
    image_key: str = spec("images", "Column of each row's images (verl's schema, one <image> per image in the "
                                    "prompt); read when actor_rollout_ref.model.path is a vision-language model.")
    video_key: str = spec("videos", "Column of videos (verl, multimodal).")
    trust_remote_code: bool = spec(False, "Allow tokenizer code shipped with the checkpoint.")
    tool_config_path: str | None = spec(None, "Tools used when measuring prompt length (verl).")
    custom_cls: PathNameConfig = spec(factory=PathNameConfig, help="Custom dataset class.")
    return_multi_modal_inputs: bool = spec(True, "Return the processor's multimodal inputs (verl).")
    sampler: SamplerConfig = spec(factory=SamplerConfig, help="Custom sampler class.")
    datagen: PathNameConfig = spec(factory=PathNameConfig, help="Dynamic data generator (verl).")
    apply_chat_template_kwargs: dict[str, Any] = spec({}, "Extra kwargs for tokenizer.apply_chat_template.")


@dataclass
class CriticModelConfig:
    """The value model (verl ``critic.model``); null keys fall back to the policy model's."""

    path: str | None = spec(None, "Value model location; null = actor_rollout_ref.model.path.")
    tokenizer_path: str | None = spec(None, "null = actor_rollout_ref.model.path.")
    override_config: dict[str, Any] = spec({}, "HF config overrides.")
    external_lib: str | None = spec(None, "null = actor_rollout_ref.model.external_lib.")
    trust_remote_code: bool | None = spec(None, "null = actor_rollout_ref.model.trust_remote_code.")
    use_shm: bool = spec(False, "Copy the files to shared memory first (verl).")
    enable_gradient_checkpointing: bool = spec(True, "Recompute each decoder layer in backward (lathe's decoder).")
    gradient_checkpointing_layers: int | None = spec(None, RECOMPUTE_LAYERS_HELP)
    enable_activation_offload: bool = spec(False, "Keep what a training forward saves for its backward "
                                                       "in pinned host memory (CUDA; lathe.train.offload).")
    use_remove_padding: bool = spec(False, "Packed (varlen) critic forward without pad tokens (lathe's decoder).")
    lora_rank: int = spec(0, "LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = spec(16, "LoRA alpha.")
    target_modules: str | list[str] = spec("all-linear", "LoRA target modules.")
    fsdp_config: FSDPConfig = spec(factory=FSDPConfig, help="Critic sharding/offload.")


@dataclass
class CriticConfig:
    """Value-function training, used when algorithm.adv_estimator=gae (verl ``critic``).

    Keys left null take the actor's value (mini-batch size, epochs, shuffle, ...).
    """

    strategy: Strategy = spec("fsdp", "Training backend (verl: fsdp|fsdp2|megatron).")
    enable: bool | None = spec(None, "Force the critic on/off; null = on exactly when adv_estimator=gae.")
    model: CriticModelConfig = spec(factory=CriticModelConfig, help="Value model.")
    optim: OptimConfig = spec(factory=lambda: OptimConfig(lr=1e-5), help="Critic optimizer (lr 1e-5).")
    ppo_mini_batch_size: int | None = spec(None, "Prompts per critic mini-batch; null = actor's.")
    ppo_micro_batch_size: int | None = spec(None, "Deprecated (verl) global micro-batch; converted.")
    ppo_micro_batch_size_per_gpu: int | None = spec(
        None, "Sequences per device per pass; null = the whole per-device mini-batch.")
    forward_micro_batch_size: int | None = spec(None, "Deprecated (verl); converted.")
    forward_micro_batch_size_per_gpu: int | None = spec(None, "Value forward micro-batch; "
                                                              "null = ppo_micro_batch_size_per_gpu.")
    use_dynamic_bsz: bool | None = spec(None, "null = actor's.")
    ppo_max_token_len_per_gpu: int = spec(32768, "Token budget per micro-batch with use_dynamic_bsz.")
    forward_max_token_len_per_gpu: int | None = spec(None, "null = ppo_max_token_len_per_gpu.")
    ppo_epochs: int | None = spec(None, "null = actor's.")
    shuffle: bool | None = spec(None, "Shuffle sequences between PPO epochs (as the actor's); null = actor's.")
    data_loader_seed: int | None = spec(None, "Seed of the shuffle's orders; null = actor's.")
    grad_clip: float = spec(1.0, "Max global gradient norm.")
    cliprange_value: float = spec(0.5, "Value clipping range around the old values.")
    loss_agg_mode: LossAggMode | None = spec(None, "null = actor's.")
    ulysses_sequence_parallel_size: int = spec(
        1, "Ulysses sequence parallelism of the critic (as actor_rollout_ref.actor.ulysses_sequence_parallel_size; "
           "needs critic.model.use_remove_padding; its token budgets are x size per micro-batch). 1: off.")
    checkpoint: CheckpointConfig = spec(factory=CheckpointConfig, help="Checkpoint contents.")
    profiler: dict[str, Any] = spec({}, "verl profiler settings.")


@dataclass
class RewardModelModelConfig:
    """A learned reward model's weights (verl ``reward_model.model``)."""

    path: str | None = spec(None, "Reward model location.")
    input_tokenizer: str | None = spec(None, "Tokenizer of the policy, when it differs from the RM's.")
    external_lib: str | None = spec(None, "Python module imported before loading (verl).")
    trust_remote_code: bool = spec(False, "Allow code shipped with the checkpoint.")
    use_shm: bool = spec(False, "Copy the files to shared memory first (verl).")
    use_remove_padding: bool = spec(False, "Packed forward without padding (verl).")
    use_fused_kernels: bool = spec(False, "Fused kernels (verl).")
    fsdp_config: FSDPConfig = spec(factory=FSDPConfig, help="RM sharding/offload.")


@dataclass
class SandboxFusionConfig:
    """Remote code-execution sandbox (verl ``reward_model.sandbox_fusion``)."""

    url: str | None = spec(None, "Code-execution sandbox service URL (verl).")
    max_concurrent: int = spec(64, "Concurrent sandbox requests.")
    memory_limit_mb: int = spec(1024, "Memory limit per execution.")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (verl recipe ``reward_model.overlong_buffer``)."""

    enable: bool = spec(False, "Penalize responses longer than max_response_length - len.")
    len: int = spec(0, "Buffer length in tokens before the hard limit.")
    penalty_factor: float = spec(0.0, "Penalty at the hard limit (grows linearly through the buffer).")
    log: bool = spec(False, "Log the penalty as a metric.")


@dataclass
class RewardModelConfig:
    """verl ``reward_model``: learned reward model and the reward manager."""

    enable: bool = spec(False, "Score with a learned reward model.")
    enable_resource_pool: bool = spec(False, "Give the reward model its own devices (verl).")
    n_gpus_per_node: int = spec(0, "Devices per node of the reward model's pool (verl).")
    nnodes: int = spec(0, "Nodes of the reward model's pool (verl).")
    strategy: Strategy = spec("fsdp", "Training backend (verl: fsdp|fsdp2|megatron).")
    model: RewardModelModelConfig = spec(factory=RewardModelModelConfig, help="Reward model weights.")
    micro_batch_size: int | None = spec(None, "Deprecated (verl) global micro-batch; converted.")
    micro_batch_size_per_gpu: int | None = spec(None, "Sequences per device per RM forward (null = actor_rollout_ref."
                                                       "rollout.log_prob_micro_batch_size_per_gpu, else the actor's "
                                                       "micro-batch).")
    max_length: int | None = spec(None, "Max RM input length in the RM's tokens; longer inputs keep their first "
                                        "max_length tokens (null = data.max_prompt_length + max_response_length).")
    use_dynamic_bsz: bool | None = spec(None, "null = critic's.")
    forward_max_token_len_per_gpu: int | None = spec(None, "Token budget per RM micro-batch.")
    ulysses_sequence_parallel_size: int = spec(1, "Sequence-parallel degree (verl).")
    reward_manager: str = spec("naive", "verl's reward manager: naive, prime, dapo, gdpo (lathe's per-response "
                                        "scoring, which keeps a dict result's numbers) or batch (one call of the "
                                        "custom function per batch, with lists).")
    launch_reward_fn_async: bool = spec(False, "Score on CPU while log-probs are computed.")
    reward_kwargs: dict[str, Any] = spec({}, "verl's reward-manager arguments: with reward_manager=batch passed to "
                                             "the custom function (with reward.reward_kwargs); DAPO's max_resp_len "
                                             "(= data.max_response_length).")
    sandbox_fusion: SandboxFusionConfig = spec(factory=SandboxFusionConfig, help="Code sandbox.")
    overlong_buffer: OverlongBufferConfig = spec(factory=OverlongBufferConfig, help="DAPO overlong penalty.")
    profiler: dict[str, Any] = spec({}, "verl profiler settings.")
    judge: JudgeConfig = spec(factory=JudgeConfig, help="lathe: a generative reward model (an LLM judge).")
    rollout: JudgeRolloutConfig = spec(factory=JudgeRolloutConfig, help="The judge's engine and sampling (verl).")


@dataclass
class CustomRewardFunctionConfig:
    """User scoring function ``fn(data_source, solution_str, ground_truth, extra_info, **kw)``."""

    path: str | None = spec(None, "Python file defining the function; null = built-in scorers.")
    name: str = spec("compute_score", "Function name in that file.")


@dataclass
class RewardConfig:
    """Rule/function rewards. verl's top-level custom_reward_function.* maps here."""

    custom_reward_function: CustomRewardFunctionConfig = spec(factory=CustomRewardFunctionConfig,
                                                              help="User scoring function.")
    reward_kwargs: dict[str, Any] = spec({}, "Extra keyword arguments passed to the scoring function.")
    timeout_s: float = spec(10.0, "lathe: per-sample scorer timeout in seconds; 0 = in-process, no timeout.")
    num_workers: int = spec(1, "lathe: scorer worker processes.")
    max_failure_fraction: float = spec(0.5, "lathe: a scoring call where more than this share of the samples fail "
                                            "(errors, timeouts) is a failing call.")
    max_failing_calls: int = spec(3, "lathe: stop the run after this many failing scoring calls in a row, showing "
                                     "the first error (0 = never stop).")


@dataclass
class KLControlConfig:
    """In-reward KL coefficient controller (verl ``algorithm.kl_ctrl``)."""

    type: KLControllerType = spec("fixed", "fixed | adaptive.")
    kl_coef: float = spec(0.001, "(Initial) KL coefficient.")
    horizon: int = spec(10000, "Adaptive controller horizon.")
    target_kl: float = spec(0.1, "Adaptive controller target KL.")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose responses all score the same."""

    enable: bool = spec(False, "Filter out zero-variance groups and regenerate.")
    metric: str | None = spec(None, "Metric compared within a group: acc, score, seq_reward, seq_final_reward.")
    max_num_gen_batches: int = spec(0, "Max generation tries per step; <= 0 = no limit.")


@dataclass
class PFPPOConfig:
    """PF-PPO, policy filtration for PPO (verl ``algorithm.pf_ppo``; ``lathe.algo.pf_ppo``)."""

    reweight_method: ReweightMethod = spec(
        "pow", "Weight of a response by its score s: pow (|s| ** weight_pow), max_min (1 at the batch's highest and "
               "lowest score, else 0), max_random (0.4 at the highest, else 0.1); plus 1e-8 each.")
    weight_pow: float = spec(2.0, "Exponent of the pow method (finite, >= 0; 0 draws uniformly).")


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction between the rollout engine and the trainer (verl names)."""

    rollout_is: ISLevel | None = spec(None, "IS weights: token | sequence | null (off).")
    rollout_is_threshold: float | str = spec(
        2.0, "IS weight bound: a number truncates weights above it (TIS); 'lower_upper' such as '0.5_5.0' zeroes "
        "weights outside the band (IcePop).")
    rollout_is_batch_normalize: bool = spec(False, "Normalize IS weights to mean 1 per batch.")
    rollout_rs: str | None = spec(None, "Rejection sampling: token | sequence | geometric | null (off).")
    rollout_rs_threshold: float | str | None = spec(
        None, "Rejection bound: one number, or 'lower_upper' for the k1 ratio tests; null = rollout_is_threshold.")
    rollout_rs_threshold_lower: float | None = spec(None, "RS lower threshold; null = 1 / upper.")
    rollout_token_veto_threshold: float | None = spec(None, "Reject a sequence if any token ratio is below.")
    bypass_mode: bool = spec(False, "Use rollout log-probs as old log-probs (skip recomputation).")
    loss_type: BypassLoss = spec("ppo_clip", "Bypass-mode loss: ppo_clip | reinforce.")
    use_policy_gradient: bool = spec(False, "Older verl spelling of loss_type=reinforce.")


_GEO_RS = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}    # geometric-mean ratio within 0.1%
_K3_RS = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}
_SEQ_TIS = {"rollout_is": "sequence", "rollout_is_threshold": 2.0}
_TOKEN_TIS = {"rollout_is": "token", "rollout_is_threshold": 2.0}
_ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}
_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}
# verl's RolloutCorrectionConfig factory presets by name (`algorithm.rollout_correction=<name>`), as field values;
# the fields a preset does not name take their defaults.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": {},
    "decoupled_token_is": _TOKEN_TIS, "decoupled_seq_is": _SEQ_TIS, "decoupled_token_icepop": _ICEPOP,
    "decoupled_seq_is_rs": {**_SEQ_TIS, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": _GEO_RS, "decoupled_geo_rs_seq_tis": {**_SEQ_TIS, **_GEO_RS},
    "decoupled_geo_rs_token_tis": {**_TOKEN_TIS, **_GEO_RS},
    "decoupled_k3_rs": _K3_RS, "decoupled_k3_rs_seq_tis": {**_SEQ_TIS, **_K3_RS},
    "decoupled_k3_rs_token_tis": {**_TOKEN_TIS, **_K3_RS},
    "bypass_ppo_clip": _PPO, "bypass_ppo_clip_geo_rs": {**_PPO, **_GEO_RS}, "bypass_ppo_clip_k3_rs": {**_PPO, **_K3_RS},
    "bypass_pg_is": {**_PG, **_SEQ_TIS}, "bypass_pg_token_icepop": {**_PG, **_ICEPOP},
    "bypass_pg_geo_rs": {**_PG, **_GEO_RS}, "bypass_pg_geo_rs_seq_tis": {**_PG, **_SEQ_TIS, **_GEO_RS},
    "bypass_pg_geo_rs_token_tis": {**_PG, **_TOKEN_TIS, **_GEO_RS},
}
# other spellings seen in verl's docs and launch scripts -> the preset meant
ROLLOUT_CORRECTION_PRESET_ALIASES = {"geo_rs_seq_tis": "decoupled_geo_rs_seq_tis",
                                     "sequence_tis_geometric_rs": "decoupled_geo_rs_seq_tis"}


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping (verl ``algorithm``)."""

    gamma: float = spec(1.0, "Discount factor.")
    lam: float = spec(1.0, "GAE lambda.")
    adv_estimator: str = spec("gae", "gae, grpo, rloo, reinforce_plus_plus, remax, ... (checked by the algo registry).")
    norm_adv_by_std_in_grpo: bool = spec(True, "GRPO: divide by the group std (false = Dr. GRPO).")
    gdpo_reward_keys: list[str] | None = spec(
        None, "GDPO (adv_estimator=gdpo, required there): the reward components to normalise each within its prompt "
              "group: keys of the dict the reward function returns (e.g. [accuracy_reward, format_reward]).")
    gdpo_reward_weights: list[float] | None = spec(
        None, "GDPO: one weight per gdpo_reward_keys entry for summing the normalised components; null = all 1.")
    use_kl_in_reward: bool = spec(False, "Subtract a KL penalty from the token rewards.")
    kl_penalty: KLEstimator = spec("kl", "In-reward KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); a "
                                         "trailing + (e.g. low_var_kl+) takes k2's gradient.")
    kl_ctrl: KLControlConfig = spec(factory=KLControlConfig, help="In-reward KL coefficient.")
    use_pf_ppo: bool = spec(False, "PF-PPO (with adv_estimator=gae): after the advantages, redraw the batch's rows "
                                   "with replacement, weighted by their scores (pf_ppo.*), before the updates.")
    pf_ppo: PFPPOConfig = spec(factory=PFPPOConfig, help="PF-PPO settings.")
    filter_groups: FilterGroupsConfig = spec(factory=FilterGroupsConfig, help="DAPO dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = spec(factory=RolloutCorrectionConfig,
                                                       help="Rollout/trainer mismatch correction: its keys, or a "
                                                            "verl preset name (e.g. decoupled_geo_rs_seq_tis).")


# groups that can be set whole by a preset name: group type -> (presets, aliases)
GROUP_PRESETS: dict[type, tuple[dict[str, dict[str, Any]], dict[str, str]]] = {
    RolloutCorrectionConfig: (ROLLOUT_CORRECTION_PRESETS, ROLLOUT_CORRECTION_PRESET_ALIASES)}


Logger = Literal["console", "tensorboard", "wandb", "mlflow", "jsonl", "file"]     # file: verl's name for jsonl


@dataclass
class TrainerConfig:
    """Run length, logging, checkpointing and placement (verl ``trainer``)."""

    total_epochs: int = spec(30, "Passes over the training set.")
    total_training_steps: int | None = spec(None, "Stop after this many steps; null = total_epochs.")
    restart_on_worker_failure: int = spec(0, "lathe: when a worker dies or stops answering, restart all workers "
                                              "from the last checkpoint and go on, at most this many times; 0 = stop "
                                              "with the rank, host and cause.")
    max_nonfinite_updates: int = spec(3, "lathe: an update whose gradient norm is inf/NaN is skipped (counted in "
                                         "actor|critic/skipped_updates, its batch saved under nonfinite_batches/); "
                                         "this many in a row stop the run (0 = never).")
    project_name: str = spec("lathe", "Project (logger group, checkpoint dir).")
    experiment_name: str = spec("default", "Run name within the project.")
    logger: list[Logger] = spec(["console", "tensorboard"], "Loggers; jsonl metrics are always written.",
                                scalar_to_list=True)
    log_val_generations: int = spec(0, "Validation samples (input, output, score) sent to the loggers per validation "
                                       "(tensorboard text, wandb table, mlflow artifact).")
    rollout_data_dir: str | None = spec(None, "Write each step's samples to <dir>/<step>.jsonl (input, output, gts, "
                                              "score, step, reward extras).")
    validation_data_dir: str | None = spec(None, "Write each validation's samples to <dir>/<step>.jsonl.")
    nnodes: int = spec(1, "Nodes.")
    n_gpus_per_node: int = spec(1, "Devices per node (lathe default 1).")
    device: Literal["auto", "cpu", "cuda"] = spec("auto", "lathe: auto = cuda when available, else cpu.")
    seed: int = spec(42, "lathe: seeds python, numpy and torch.")
    save_freq: int = spec(-1, "Save a checkpoint every N steps; -1 = never.")
    test_freq: int = spec(-1, "Validate every N steps; -1 = never.")
    val_before_train: bool = spec(True, "Validate once before the first step.")
    val_only: bool = spec(False, "Only validate, then exit.")
    critic_warmup: int = spec(0, "Steps that train only the critic.")
    balance_batch: bool = spec(True, "Balance token counts across devices.")
    resume_mode: Literal["auto", "disable", "resume_path"] = spec(
        "auto", "auto = resume from the latest checkpoint in default_local_dir if any.")
    resume_from_path: str | None = spec(None, "Checkpoint dir used when resume_mode=resume_path.")
    resume_fallback_to_verified: bool = spec(
        False, "lathe: with resume_mode=auto, when the latest checkpoint does not match its manifest (a file missing, "
               "truncated or changed), resume from the newest earlier checkpoint that does, with a warning; false = "
               "stop with an error naming both.")
    default_local_dir: str = spec("checkpoints/${trainer.project_name}/${trainer.experiment_name}",
                                  "Checkpoint directory.")
    default_hdfs_dir: str | None = spec(None, "Copy checkpoints to this HDFS directory (verl).")
    del_local_ckpt_after_load: bool = spec(False, "Delete the local checkpoint once loaded (verl).")
    remove_previous_ckpt_in_save: bool = spec(False, "Old verl key: keep one checkpoint (max_actor_ckpt_to_keep=1).")
    max_actor_ckpt_to_keep: int | None = spec(None, "Keep only the newest N actor checkpoints; null = all.")
    max_critic_ckpt_to_keep: int | None = spec(None, "Keep only the newest N critic checkpoints; null = all.")
    esi_redundant_time: int = spec(0, "Seconds before an elastic instance expires to save (verl).")
    ray_wait_register_center_timeout: int = spec(300, "Seconds to wait for Ray workers to register.")
    use_legacy_worker_impl: LegacyWorkerImpl = spec("auto", "verl's worker implementation: auto | enable | disable.")
    use_v1: bool = spec(True, "verl's V1 trainer, which runs trainer.v1.trainer_mode; false = verl's legacy trainer "
                              "(lathe's synchronous loop), which reads no trainer.v1 key.")
    v1: TrainerV1Config = spec(factory=TrainerV1Config, help="verl V1's trainer mode (sync / colocate_async) and "
                                                              "its settings.")


@dataclass
class GlobalProfilerConfig:
    """verl ``global_profiler``: which steps to profile, with which tool, into which directory."""

    tool: ProfilerTool | None = spec(None, "Profiler: torch = a PyTorch profiler trace and a per-phase summary of each listed "
                                  "step (lathe.track.profile); torch_memory = a CUDA memory snapshot (allocator "
                                  "history) of each listed step, per rank (lathe.track.memory_history); null = off. "
                                  "nsys/npu are not implemented.")
    steps: list[int] | None = spec(None, "Steps to profile (the first step is 1); null = none (torch_memory: step 1).")
    profile_continuous_steps: bool = spec(False, "One trace across consecutive listed steps (not implemented: lathe "
                                                 "writes one trace per step).")
    save_path: str = spec("outputs/profile", "Directory of the traces and snapshots: <save_path>/step_<N>/.")
    with_stack: bool = spec(False, "lathe: also record Python frames (torch.profiler with_stack): the trace then shows "
                                   "which Python functions the host's time went to; the step runs slower.")
    global_tool_config: dict[str, Any] = spec({}, "Settings per tool: torch_memory.{trace_alloc_max_entries, context, "
                                                  "stacks, kw_args} (torch's _record_memory_history; stack_depth is "
                                                  "accepted but torch takes none); the nsys/npu tools' are unread.")


@dataclass
class LatheConfig:
    """The whole run: verl's top-level groups plus lathe's ``reward`` group."""

    data: DataConfig = spec(factory=DataConfig, help="Datasets and batch size.")
    actor_rollout_ref: ActorRolloutRefConfig = spec(factory=ActorRolloutRefConfig,
                                                    help="Policy model, actor, ref and rollout.")
    critic: CriticConfig = spec(factory=CriticConfig, help="Value function (GAE).")
    reward_model: RewardModelConfig = spec(factory=RewardModelConfig, help="Reward model / manager.")
    reward: RewardConfig = spec(factory=RewardConfig, help="Rule and function rewards.")
    algorithm: AlgorithmConfig = spec(factory=AlgorithmConfig, help="Advantage and KL settings.")
    trainer: TrainerConfig = spec(factory=TrainerConfig, help="Run control.")
    rollout: RolloutPoolConfig = spec(factory=RolloutPoolConfig, help="The rollout's own device pool (fully "
                                                                      "asynchronous training).")
    async_training: AsyncTrainingConfig = spec(factory=AsyncTrainingConfig, help="Fully asynchronous training.")
    distillation: DistillationConfig = spec(factory=DistillationConfig, help="On-policy distillation from teacher "
                                                                           "models (verl).")
    ray_kwargs: dict[str, Any] = spec({}, "Ray settings (e.g. ray_init.num_cpus) for multi-node runs.")
    ray_init: dict[str, Any] = spec({}, "Older verl spelling of ray_kwargs.ray_init.")
    global_profiler: GlobalProfilerConfig = spec(factory=GlobalProfilerConfig, help="Profiling of chosen steps.")
    hydra: dict[str, Any] = spec({}, "Hydra's own settings in verl scripts; ignored.")
    model_engine: ModelEngine = spec("dp", "verl's training backend for every role (dp = fsdp, megatron, veomni, "
                                           "torchtitan); lathe trains each with its FSDP2 trainer.")
    verl_keys: dict[str, Any] = spec({}, "verl keys lathe has no field for (backend, profiler, QAT, ... subtrees), "
                                         "by dotted key, as set by their own names; lathe.config.support_verl judges "
                                         "each (translated, refused, no effect or the same either way).")

    @property
    def custom_reward_function(self) -> CustomRewardFunctionConfig:
        """verl's old top-level spelling of ``reward.custom_reward_function``."""
        return self.reward.custom_reward_function
