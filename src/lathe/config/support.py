"""The one list of config keys lathe accepts (verl's names) but does not act on yet, and what it does with them.

Every key of the config tree is either read by lathe's code or listed here (``tests/config/
test_key_coverage.py`` checks both ways). ``check_support`` runs inside ``load_config`` on the values as
given (before fill-ins): a refused value is a ConfigError listing every problem at once; keys with no effect
are named together in one ``IgnoredKeysWarning``. ``docs/config_keys.md`` is generated from this list:

    PYTHONPATH=src python -c "from lathe.config.support import markdown; print(markdown())" > docs/config_keys.md

When a feature lands, its entries go (and the test then checks that the code reads the keys).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

from .errors import IgnoredKeysWarning, ProblemList
from .coerce import show
from .schema import LatheConfig
from .plan import is_async
from .rules_reward import BATCH_MANAGER, PER_ROW_MANAGERS
from .support_base import Entry, at_most, inert, no_entries, one_of, only_on, refuse, same_as, warn
from .support_base import defaults as _defaults
from .support_rollout import ROLLOUT_FEATURES
from .support_v1 import V1_FEATURES
from .support_verl import BACKEND, ULYSSES_RM, backend_judge, judge_verl_keys, markdown_lines
from .tree import get_path

A, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
R, M = "actor_rollout_ref.rollout", "actor_rollout_ref.model"
C, RM = "critic", "reward_model"
TRAINED = (A, REF, f"{C}.model")                      # the fsdp_config groups of models lathe loads


def _multi_gpu() -> list[Entry]:
    out = [replace(warn("model_engine", BACKEND), judge=backend_judge("model_engine"))]
    out += [replace(warn(f"{g}.strategy", BACKEND), judge=backend_judge(f"{g}.strategy")) for g in (A, REF, C)]
    out += [replace(warn(f"{A}.model_engine", BACKEND), judge=backend_judge(f"{A}.model_engine"))]
    out += [inert(f"{g}.fsdp_config.strategy", "fsdp and fsdp2 both train with PyTorch FSDP2") for g in TRAINED]
    out += [replace(refuse("actor_rollout_ref.hybrid_engine", "actor and rollout on separate devices without a "
                           "rollout pool (fully-asynchronous training)",
                           "set rollout.n_gpus_per_node"), judge=_hybrid_engine)]
    return out


def _hybrid_engine(value, cfg) -> tuple[str, str] | None:
    """hybrid_engine=false (verl's fully-async scripts) acts through the rollout pool; alone it cannot."""
    if value or is_async(cfg):
        return None
    return "refuse", ("`actor_rollout_ref.hybrid_engine`=false asks for the rollout on devices of its own, but no "
                      "rollout pool is set (rollout.n_gpus_per_node=0). Fix: set rollout.nnodes and "
                      "rollout.n_gpus_per_node (fully asynchronous training), or remove hybrid_engine=false.")


def _needs_pool(key: str):
    """An async_training/rollout-pool key set in synchronous training is refused (it would act on nothing)."""
    def judge(value, cfg) -> tuple[str, str] | None:
        if value == get_path(_defaults(), key):
            return None
        return "refuse", (f"`{key}`={show(value)} acts only in fully-asynchronous training, which needs a rollout "
                          "pool of its own. Fix: set rollout.n_gpus_per_node (and rollout.nnodes), or remove "
                          f"{key}.")
    return judge


def _async() -> list[Entry]:
    keys = [f"async_training.{k}" for k in ("staleness_threshold", "trigger_parameter_sync_step", "require_batches",
                                           "partial_rollout", "use_rollout_log_probs", "compute_prox_log_prob",
                                           "checkpoint_engine.enable", "checkpoint_engine.device_buffer_size_M")]
    keys += [f"rollout.{k}" for k in ("nnodes", "total_rollout_steps", "total_epochs", "test_freq")]
    text = "this key in synchronous training (it acts with a rollout pool of its own: rollout.n_gpus_per_node > 0)"
    out = [only_on("synchronous training", replace(refuse(k, text, "set rollout.n_gpus_per_node"),
                                                   judge=_needs_pool(k))) for k in keys]
    out += [warn("async_training.checkpoint_engine.overlap_broadcast_and_consume",
                 "lathe's weight sync always receives the next bucket while the engine loads the last"),
            warn("async_training.checkpoint_engine.bypass_cpu", "lathe's weight sync never passes through host "
                                                                "memory on GPUs"),
            only_on("synchronous training", warn(f"{R}.update_weights_bucket_megabytes", (
                "colocated, weights reach the engine tensor by tensor, without buckets (it sizes the buckets of "
                "fully-async training's weight sync)")))]
    return out


def _one_device() -> list[Entry]:
    out = [only_on("one device", warn(f"{g}.fsdp_config.reshard_after_forward",
                                      "a sharding setting, with nothing to shard on one device")) for g in TRAINED]
    out += [warn(f"{g}.fsdp_config.{k}", why) for g in TRAINED for k, why in (
        ("forward_prefetch", "FSDP2 prefetches the next layer's gather by itself"),
        ("use_orig_params", "an FSDP1 setting; FSDP2 always keeps the original parameters"),
        ("wrap_policy", "lathe shards each decoder layer and the root, whatever the policy"))]
    out += [only_on("one device", warn("trainer.balance_batch", "it balances tokens across devices; there is one"))]
    out += [only_on("one process", warn(k, why)) for k, why in (
        ("actor_rollout_ref.nccl_timeout", "no collectives run on one device without a rollout pool"),
        ("ray_kwargs", "Ray is not used on one device without a rollout pool"),
        ("ray_init", "Ray is not used on one device without a rollout pool"))]
    out = [replace(e, ok=no_entries) if e.key in ("ray_kwargs", "ray_init") else e for e in out]
    out += [warn("trainer.ray_wait_register_center_timeout", "lathe's workers have no register center"),
            warn("trainer.esi_redundant_time", "it is for Volcano Engine elastic instances"),
            warn(f"{R}.layered_summon", "lathe always gathers sharded weights one tensor at a time")]
    return out


def _lora() -> list[Entry]:
    out = [only_on("critic.model.lora_rank=0", warn(f"{C}.model.{k}", "it is read only with critic.model.lora_rank > "
                                                    "0")) for k in ("lora_alpha", "target_modules")]
    out += [only_on("lora_rank=0", warn(f"{M}.{k}", "it is read only with lora_rank > 0"))
            for k in ("lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path", "lora_dropout")]
    return out


def _multi_turn() -> list[Entry]:
    mt = f"{R}.multi_turn"
    out = [only_on("single-turn", warn("data.tool_config_path", "tools are used only by multi-turn rollouts "
                                       "(rollout.multi_turn.enable=true)"))]
    for k in ("use_inference_chat_template", "tokenization_sanity_check_mode"):
        out.append(warn(f"{mt}.{k}", "lathe never re-tokenises a conversation: the model's turns stay as sampled "
                        "and the tokens between them are the chat template's own (checked token by token in "
                        "lathe's tests), so there is nothing to choose or check"))
    needs = "it is read only with rollout.multi_turn.enable=true"
    out += [only_on("single-turn", warn(f"{mt}.{k}", needs)) for k in (
        "max_assistant_turns", "max_user_turns", "tool_config_path", "function_tool_path", "interaction_config_path",
        "max_parallel_calls",
        "max_tool_response_length", "tool_timeout", "max_concurrent_tool_calls")]
    return out


def _async_reward_model(value, cfg) -> tuple[str, str] | None:
    """reward_model.enable with a rollout pool: the trainer thread scores each batch with the reward model just before
    its update (`lathe.loop.fully_async_learn.learn_batch`), on the trainer pool's ranks or on the reward model's own
    pool (`enable_resource_pool`). What would need those scores earlier, on the driver as each request arrives, is
    refused rather than computed from other scores (an own pool changes nothing there: it too scores in the trainer
    thread)."""
    if not value:
        return None
    fix = ("or remove reward_model.enable, or train synchronously (rollout.n_gpus_per_node=0), where the reward "
           "model scores each step's samples before anything reads them")
    clashes = []
    if cfg.algorithm.filter_groups.enable:
        clashes.append(f"`algorithm.filter_groups.enable`=true with `{RM}.enable`=true in fully-asynchronous "
                       "training: DAPO's dynamic sampling filters each request's groups by their scores on the driver "
                       "as they arrive, but the reward model scores a batch (on the trainer pool, or its own pool) "
                       f"just before its update. Fix: set algorithm.filter_groups.enable=false, {fix}.")
    if cfg.algorithm.adv_estimator == "remax":
        clashes.append(f"`algorithm.adv_estimator`=remax with `{RM}.enable`=true in fully-asynchronous training: "
                       "ReMax's baseline is the score of each request's greedy response, taken on the driver as the "
                       "request arrives, but the reward model scores (on the trainer pool, or its own pool) just "
                       "before an update. "
                       f"Fix: use another estimator (grpo, rloo, ...), {fix}.")
    return ("refuse", " ".join(clashes)) if clashes else None


def _rewards() -> list[Entry]:
    out = [only_on("a rollout pool", replace(refuse(
               f"{RM}.enable", "a learned reward model or judge in fully-asynchronous training with DAPO's "
               "dynamic sampling (algorithm.filter_groups.enable) or ReMax (algorithm.adv_estimator=remax), which "
               "read scores on the driver as each request arrives; otherwise it runs: the trainer thread scores each "
               f"batch before its update, on the trainer pool's ranks or its own pool ({RM}.enable_resource_pool)",
               "remove that key, or train synchronously (rollout.n_gpus_per_node=0)"), judge=_async_reward_model)),
           refuse(f"{RM}.reward_manager", "that reward manager (lathe's are verl's naive/prime/dapo/gdpo: "
                  "per-response scoring in worker processes with timeouts, a dict result's numbers kept; and batch: "
                  "one call of a custom function per batch)",
                  "set it to naive (or batch, with reward.custom_reward_function.path)",
                  one_of(*PER_ROW_MANAGERS, BATCH_MANAGER)),
           replace(refuse(f"{RM}.reward_kwargs", "arguments for the naive/prime/dapo/gdpo managers (verl passes "
                          "them to the manager: naive and prime take none, DAPO's max_resp_len and "
                          "overlong_buffer_cfg)", "pass arguments for your function in "
                          "custom_reward_function.reward_kwargs, or set reward_model.reward_manager=batch, which "
                          "passes these to the function too; DAPO's overlong shaping is reward_model.overlong_buffer."
                          "{{enable,len,penalty_factor,log}} and its max_resp_len is data.max_response_length"),
                   ok=lambda v, cfg: cfg.reward_model.reward_manager == BATCH_MANAGER or set(v) <= {"max_resp_len"}
                   and v.get("max_resp_len", cfg.data.max_response_length) == cfg.data.max_response_length),
           only_on("a rollout pool or filter_groups", warn(
               f"{RM}.launch_reward_fn_async", "with a rollout pool the driver already scores each request as it "
               "arrives while the trainer pool trains (a reward model's scores: the trainer pool, just before each "
               "update); with algorithm.filter_groups.enable DAPO's dynamic sampling "
               "chooses the step's samples by their scores before any log-prob pass, so they are scored in the "
               "foreground (as verl's DAPO trainer does); the scores are the same")),
           only_on("no reward model", warn(f"{RM}.enable_resource_pool", f"it is read only with {RM}.enable=true")),
           *[only_on("no reward pool", warn(f"{RM}.{k}", f"it is read only with {RM}.enable=true and "
                                                         f"{RM}.enable_resource_pool=true (the reward model's own pool)"))
             for k in ("n_gpus_per_node", "nnodes")],
           refuse(f"{RM}.ulysses_sequence_parallel_size", ULYSSES_RM, "set it to 1", at_most(1)),
           refuse(f"{RM}.model.fsdp_config.tensor_parallel_size", "tensor parallelism for the reward model (a whole "
                  "copy on each device)", "set it to 1", at_most(1)),
           warn(f"{RM}.model.fsdp_config.keep_gathered", "the reward model is a whole copy on each device (no "
                "FSDP2 gathers to keep)", lambda v, cfg: v is None),
           refuse(f"{RM}.model.fsdp_config.expert_parallel_size", "expert parallelism for the reward model (a whole "
                  "copy on each device)", "set it to 1", at_most(1)),
           replace(warn(f"{RM}.strategy", BACKEND), judge=backend_judge(f"{RM}.strategy")),
           refuse(f"{RM}.model.input_tokenizer", "decoding the responses with a tokenizer other than the policy's",
                  f"remove it: the reward model reads the policy's responses with {M}.tokenizer_path (or {M}.path) "
                  "and renders them with its own chat template when its tokenizer differs",
                  lambda v, cfg: v is None or v in (cfg.actor_rollout_ref.model.tokenizer_path,
                                                    cfg.actor_rollout_ref.model.path)),
           warn(f"{RM}.model.use_shm", "copying the weights to shared memory only speeds up loading"),
           warn(f"{RM}.model.use_remove_padding", "lathe's reward model scores packed micro-batches (no padding) "
                "whenever lathe's decoder runs its architecture, padded ones on transformers' fallback; the scores "
                "are the same"),
           warn(f"{RM}.model.use_fused_kernels", "a reward model's forward has no fused kernels in lathe")]
    # read by the reward model (lathe.workers.reward_model) when it is enabled; no effect otherwise
    off = f"it is read only with {RM}.enable=true"
    read = ["model.path", "model.external_lib", "model.trust_remote_code", "model.fsdp_config.param_offload"]
    out += [only_on("no reward model", warn(f"{RM}.{k}", off)) for k in read]
    # the sequence-classification model's micro-batching; a generative judge batches on its engine
    off = f"it is read only by a sequence-classification reward model ({RM}.enable=true, {RM}.judge.enable=false)"
    out += [only_on("no classifier reward model", warn(f"{RM}.{k}", off))
            for k in ("micro_batch_size", "micro_batch_size_per_gpu", "max_length", "use_dynamic_bsz")]
    out.append(only_on("no classifier reward model", warn(f"{RM}.forward_max_token_len_per_gpu", off, same_as(
        f"{C}.forward_max_token_len_per_gpu", f"{C}.ppo_max_token_len_per_gpu"))))
    whole = "the reward model is a whole copy on each device (not sharded by FSDP)"
    out += [warn(f"{RM}.model.fsdp_config.{k}", whole) for k in (
        "offload_policy", "reshard_after_forward", "fsdp_size", "forward_prefetch", "use_orig_params", "wrap_policy",
        "strategy")]
    out += [warn(f"{RM}.model.fsdp_config.{k}", "a reward model has no optimizer or gradients")
            for k in ("optimizer_offload", "grad_offload")]
    dtypes = "lathe's reward model computes in bfloat16 on an accelerator and float32 on the CPU"
    out += [warn(f"{RM}.model.fsdp_config.{k}", dtypes) for k in (
        "model_dtype", "mixed_precision.param_dtype", "mixed_precision.reduce_dtype", "mixed_precision.buffer_dtype")]
    out.append(warn(f"{RM}.model.fsdp_config.use_torch_compile", "lathe's reward model runs eagerly"))
    return out


def _distillation() -> list[Entry]:
    d, loss = "distillation", "distillation.distillation_loss"
    pool = (f"it is read only with {d}.enabled=true and both {d}.nnodes and {d}.n_gpus_per_node >= 1 (the teachers' "
            "own pool, one whole copy of each teacher per device; else they share the trainer's devices, like the "
            "reference)")
    return [only_on("no teacher pool", warn(f"{d}.{k}", pool)) for k in ("nnodes", "n_gpus_per_node")] + [
            refuse(f"{loss}.policy_loss_mode", "a distillation surrogate other than PPO's vanilla clipped loss "
                   "(verl implements only vanilla)", "set it to vanilla", one_of("vanilla"))]


def _memory() -> list[Entry]:
    out = [only_on("one device", refuse(f"{g}.fsdp_config.offload_policy", "FSDP2's CPU offload policy on one "
                                         "device", "remove it; fsdp_config.param_offload and optimizer_offload are "
                                         "the offload switches on one device")) for g in TRAINED]
    out += [refuse(f"{g}.fsdp_config.grad_offload", "gradient offload (an old verl key)") for g in TRAINED]
    return out


def _data() -> list[Entry]:
    def policy_tok(cfg) -> str:
        return cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path

    out = [refuse("data.tokenizer", "tokenizing prompts with a tokenizer other than the policy's",
                  f"remove it; prompts use {M}.tokenizer_path (or {M}.path)",
                  lambda v, cfg: v is None or v == policy_tok(cfg)),
           refuse(f"{C}.model.tokenizer_path", "a critic tokenizer other than the policy's",
                  "remove it: the critic reads the policy's tokens", lambda v, cfg: v is None or v == policy_tok(cfg)),
           refuse("data.video_key", "video prompts (lathe's vision-language models take images only)",
                  "remove it (or set it back to {default}); give a video as image frames in the data.image_key "
                  "column, one <image> placeholder per frame"),
           warn("data.return_multi_modal_inputs", "lathe always gives a vision-language model its images' "
                "processor outputs (pixel_values, image_grid_thw)")]
    out += [refuse(f"data.{group}.{k}", what, "remove it; write the data as verl-schema parquet/jsonl "
                   "(see `lathe preprocess`)") for group, what, keys in (
        ("sampler", "a custom (curriculum) sampler", ("class_path", "class_name")),
        ("datagen", "dynamic data generation", ("path", "name"))) for k in keys]
    once = "lathe reads and tokenizes the data once at start-up, in the trainer process"
    out += [warn("data.use_shm", "copying data to shared memory only speeds up loading"),
            warn("data.dataloader_num_workers", once), warn("data.filter_overlong_prompts_workers", once),
            warn("data.validation_shuffle", "validation covers the whole set; its order does not change the metrics"),
            inert("data.return_raw_input_ids", "lathe's reward model re-renders each row from its chat messages when "
                  "its tokenizer differs from the policy's"),
            warn("data.return_full_prompt", "lathe's reward model and agent loop render each row from its chat "
                 "messages, which lathe always keeps"),
            inert("data.return_raw_chat", "lathe always keeps each row's chat messages")]
    return out


def _models() -> list[Entry]:
    fused = "lathe's decoder computes log-probs and entropy with its own chunked kernels"
    out = [refuse(f"{M}.hf_config_path", "reading the model config from a separate path",
                  f"remove it; keep config.json with the weights in {M}.path (single keys: {M}.override_config)",
                  lambda v, cfg: v is None or v == cfg.actor_rollout_ref.model.path),
           warn(f"{A}.use_remove_padding", f"lathe packs the actor's and the reference's sequences by "
                f"{M}.use_remove_padding (set that instead)",
                lambda v, cfg: v is True or v == cfg.actor_rollout_ref.model.use_remove_padding),
           warn(f"{M}.use_liger", "lathe's decoder is its own implementation; Liger's kernels are not used"),
           warn(f"{M}.use_fused_kernels", fused), warn(f"{M}.fused_kernel_options", fused),
           warn(f"{A}.use_fused_kernels", fused)]
    out += [warn(f"{m}.use_shm", "copying the model to shared memory only speeds up loading")
            for m in (M, f"{C}.model")]
    out += [warn(f"{g}.{k}", "lathe's decoder always computes entropy chunk by chunk and recomputes it in backward")
            for g in (A, REF) for k in ("entropy_from_logits_with_chunking", "entropy_checkpointing")]
    return out     # (model.mtp.enable_rollout and its speculative keys act: config/rules_mtp.py checks them)


def _training() -> list[Entry]:
    out = [refuse(f"{A}.tis_imp_ratio_cap", "the old truncated-IS cap",
                  "use algorithm.rollout_correction.rollout_is=token rollout_is_threshold={value}", at_most(0)),
           refuse(f"{A}.use_token_level_loss", "an old verl DAPO key", f"use {A}.loss_agg_mode=token-mean (true) or "
                  "seq-mean-token-mean (false)"),
           refuse("algorithm.rollout_correction.rollout_rs_threshold_lower", "a separate rejection lower bound",
                  "give both bounds in rollout_rs_threshold as 'lower_upper', e.g. '0.5_2.0'"),
           refuse("algorithm.rollout_correction.rollout_token_veto_threshold", "the per-token veto"),
           refuse(f"{R}.over_sample_rate", "over-sampling rollouts (aborting the slowest)", ok=at_most(0)),
           refuse(f"{R}.skip_rollout", "replaying dumped rollouts instead of generating (skip_rollout)"),
           warn(f"{R}.skip_dump_dir", f"it is read only with {R}.skip_rollout=true (not implemented yet)"),
           refuse(f"{R}.use_fire_sampling", "FIRE sampling (an old verl key)"),
           refuse(f"{R}.chat_scheduler", "the chat scheduler (an old verl key)")]
    for g in (A, C):
        out += [warn(f"{g}.optim.total_training_steps", "it is set at run time from trainer.total_training_steps "
                                                        "(or the epochs)")]
    return out


ALWAYS_SAVED = {"model", "optimizer", "extra"}


def _checkpoints() -> list[Entry]:
    out = [refuse("trainer.default_hdfs_dir", "copying checkpoints to HDFS"),
           refuse("trainer.del_local_ckpt_after_load", "deleting the local checkpoint after loading it"),
           refuse("trainer.remove_previous_ckpt_in_save", "an old verl key", "set trainer.max_actor_ckpt_to_keep=1"),
           refuse("trainer.max_critic_ckpt_to_keep", "keeping a different number of critic than actor checkpoints "
                  "(both live in one global_step_N directory)", "remove it; trainer.max_actor_ckpt_to_keep prunes "
                  "whole checkpoints", lambda v, cfg: v is None or v == cfg.trainer.max_actor_ckpt_to_keep)]
    for g in (A, C):
        out += [refuse(f"{g}.checkpoint.load_contents", "loading only part of a checkpoint",
                       "remove it: lathe resumes model, optimizer and extra",
                       lambda v, cfg: ALWAYS_SAVED <= set(v)),
                warn(f"{g}.checkpoint.save_contents", "lathe always saves model (in Hugging Face format, so hf_model "
                     "too), optimizer and extra", lambda v, cfg: set(v) - {"hf_model"} == ALWAYS_SAVED),
                warn(f"{g}.checkpoint.async_save", "checkpoints are saved synchronously; the files are the same")]
    return out


def _profiler_off(value, cfg) -> bool:
    """verl's per-role profiler at rest: not enabled, no ranks chosen."""
    return not any(value.get(k) for k in ("enable", "all_ranks", "ranks", "discrete"))


def _observability() -> list[Entry]:
    per_role = ("profiling is chosen per step, not per role: global_profiler.tool=torch (or torch_memory) covers "
                "every phase and rank of the listed steps (lathe.track.profile)")
    out = [warn(f"{g}.profiler", per_role, _profiler_off) for g in (A, REF, R, C, RM)]
    out += [refuse("global_profiler.profile_continuous_steps", "one trace across consecutive profiled steps",
                   "remove it: lathe writes one trace per listed step"),
            warn(f"{R}.trace", "rollout tracing is not implemented yet"),
            warn(f"{R}.disable_log_stats", "lathe's engine has no periodic stats log (its time is timing_s/gen)"),
            warn(f"{R}.multi_stage_wake_up", "lathe's engine wakes up in one stage")]
    return out


def _same_either_way() -> list[Entry]:
    return [inert(f"{R}.mode", "lathe's engine batches each step's prompts continuously in either mode"),
            inert(f"{R}.calculate_log_probs", "the rollout always returns its log-probs"),
            inert(f"{R}.load_format", "the engine always starts from the actor's weights"),
            inert(f"{R}.skip_tokenizer_init", "lathe's engine works on token ids"),
            inert("trainer.use_legacy_worker_impl", "lathe has one worker implementation"),
            inert("hydra", "Hydra's own settings; lathe does not run Hydra")]


FEATURES = {
    "Multi-GPU and multi-node (Ray / FSDP2)": _multi_gpu,
    "Fully asynchronous training (a rollout pool of its own)": _async,
    "LoRA": _lora,
    "Multi-turn rollouts and tools": _multi_turn,
    "Reward models, reward managers, code sandbox": _rewards,
    "On-policy distillation": _distillation,
    "Memory offload": _memory,
    "Data pipeline and multimodal data": _data,
    "Model loading and kernels": _models,
    "Training and algorithm options": _training,
    "Checkpoints": _checkpoints,
    "Profiling, tracing, engine logs": _observability,
    "Distribution settings with no effect (on one device, or at all)": _one_device,
    "Accepted: lathe behaves the same either way": _same_either_way,
    **ROLLOUT_FEATURES,
    **V1_FEATURES,
}


@functools.lru_cache(maxsize=1)
def registry() -> dict[str, Entry]:
    """Every entry by key, each tagged with its feature heading (first listing wins)."""
    out: dict[str, Entry] = {}
    for feature, entries in FEATURES.items():
        for entry in entries():
            if entry.key in out:
                raise RuntimeError(f"config/support.py lists {entry.key} twice")
            out[entry.key] = replace(entry, feature=feature)
    return out


def check_support(cfg: LatheConfig, problems: ProblemList, *, skip: frozenset[str] = frozenset(),
                  stacklevel: int = 3) -> None:
    """Refused values go to ``problems``; values with no effect are named in one IgnoredKeysWarning."""
    ignored = []
    for key, entry in registry().items():
        if key in skip:
            continue
        verdict = entry.verdict(get_path(cfg, key), get_path(_defaults(), key), cfg)
        if verdict is None:
            continue
        kind, message = verdict
        if kind == "refuse":
            problems.add(message)
        else:
            ignored.append(message)
    for kind, message in judge_verl_keys(cfg):
        if kind == "refuse":
            problems.add(message)
        else:
            ignored.append(message)
    if ignored:
        lines = "\n".join(f"  - {m}" for m in ignored)
        warnings.warn(f"{len(ignored)} config key(s) set here have no effect in lathe:\n{lines}",
                      IgnoredKeysWarning, stacklevel=stacklevel)


def support_note(key: str) -> str:
    """The registry's sentence for ``key`` ('' for keys lathe acts on)."""
    entry = registry().get(key)
    return entry.note() if entry else ""


def markdown() -> str:
    """docs/config_keys.md: every registry entry under its feature heading (generated; a test keeps it current)."""
    lines = ["# Config keys lathe accepts but does not act on yet", "",
             "Generated from `src/lathe/config/support.py` (see its docstring); do not edit by hand.", "",
             "- **refused**: a value other than the default fails `load_config` (before any model loads), "
             "naming the key and the fix.",
             "- **no effect**: a value other than the default is accepted with one warning listing such keys.",
             "- **same either way**: lathe already behaves as the key asks; accepted silently.", ""]
    label = {"refuse": "refused", "warn": "no effect", "inert": "same either way"}
    for feature in FEATURES:
        entries = [e for e in registry().values() if e.feature == feature]
        lines += [f"## {feature}", "", "| key | default | status | why / fix |", "| --- | --- | --- | --- |"]
        for e in entries:
            default = show(get_path(_defaults(), e.key))
            fix = e.format(e.fix, None, get_path(_defaults(), e.key), shown="<value>")
            why = f"{e.text}; fix: {fix}" if e.kind == "refuse" else e.text
            lines.append(f"| `{e.key}` | `{default}` | {label[e.kind]} | {why.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines + markdown_lines())

