"""What lathe does with each verl key it has no field for (the keys ``LatheConfig.verl_keys`` holds).

The registry of ``support.py`` names lathe's own fields one by one; verl's backend, profiler, optimizer and
feature subtrees are judged here by pattern (``fnmatch`` over the dotted key, ``*`` crossing dots; the first
pattern that matches wins), with the same kinds: translated (``verl_translate.py`` set lathe's key),
``refuse`` (a value other than verl's default fails, naming the feature and the lathe issue that builds it),
``warn`` (no effect; one warning lists such keys) and ``inert``. ``tests/config/test_verl_keys.py`` checks that
every key of ``verl_keys.yaml`` matches a pattern here, and ``docs/config_keys.md`` lists the patterns.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

from .coerce import show
from .plan import needs_ref, trainer_devices
from .support_base import Entry, at_most, inert, one_of, refuse, same_as, warn
from .support_rollout import ROUTING
from .tree import get_path
from .verl_keys import flatten, is_verl_group, is_verl_key, verl_default, verl_defaults
from .verl_translate import (DIST_USE, RECOMPUTE, RULES, TRAINED_MODEL, block_recompute_layers,
                             context_parallel_notice, dist_checkpoint, dist_checkpoint_prefix, lora_experts_notice,
                             megatron_recompute, pipeline_notice, rule_for, tp_beside_ep_notice, translate)

ISSUE_43 = "lathe issue 43: big models on many GPUs"
ISSUE_44 = "lathe issue 44: MoE, MTP, routing replay"
ISSUE_46 = "lathe issue 46: reward models, judges, distillation"
ISSUE_48 = "lathe issue 48: FP8 and quantized training"
# the names of refused features (the corpus test groups failures by them: keep them stable)
CP = f"context parallelism ({ISSUE_43})"
ETP = f"expert tensor parallelism ({ISSUE_43})"     # expert parallelism itself: fsdp_config.expert_parallel_size
ULYSSES_RM = f"Ulysses sequence parallelism for the reward model ({ISSUE_43})"
REPLICAS = "torchtitan's replica count given directly (lathe's hybrid sharding takes the shard size)"
MTP = f"multi-token prediction (MTP; {ISSUE_44})"
ROUTER_REPLAY = ROUTING                                  # the rollout's name for the same feature
MOE_LOSSES = f"MoE router training settings (auxiliary losses, load balancing; {ISSUE_44})"
QAT = f"quantization-aware training (QAT; {ISSUE_48})"
FP8 = f"FP8 training ({ISSUE_48})"
LOW_PRECISION_OPTIM = f"low-precision optimizer state ({ISSUE_48})"
ONE = "set it to 1"
KERNELS = "lathe's decoder has kernels of its own and reads the architecture from the checkpoint's config.json"
ENTROPY = "lathe's decoder always computes entropy chunk by chunk and recomputes it in backward"
CKPT_FORMAT = "lathe loads and saves Hugging Face weights (and its own checkpoints) directly"
SAME_MATH = "it changes padding or layout, not what is computed"


# Megatron's / torchtitan's pipeline-parallel sizes (verl_translate.pipeline_notice: one notice names them)
PIPELINE = ("translated: FSDP sharding over those devices (pipeline stages compute the same loss and gradients as the "
            "whole model: a layout, not another computation); a mini-batch is then split over those devices too")
STAGES = "a pipeline-stage layout setting; lathe runs no stages (a pipeline-parallel size runs as FSDP sharding)"


def _devices_or_all(v: Any, cfg: Any) -> bool:
    return v is None or v in (-1, 1, trainer_devices(cfg))


def _parallel() -> list[Entry]:
    out = [inert(p, PIPELINE) for p in ("*.megatron.pipeline_model_parallel_size",
                                        "*.megatron.virtual_pipeline_model_parallel_size",
                                        "*.torchtitan.pipeline_parallel_size", "*.engine.pp", "*.engine.vpp")]
    out += [refuse(p, ETP, ONE, at_most(1)) for p in ("*.megatron.expert_tensor_parallel_size", "*.engine.etp")]
    out += [refuse("*.megatron.dynamic_context_parallel", CP),
            refuse("*.torchtitan.data_parallel_replicate_size", REPLICAS, "remove it and set data_parallel_shard_size "
                   "(or fsdp_config.fsdp_size) to the devices / replicas", at_most(1)),
            warn("*.megatron.max_seqlen_per_dp_cp_rank", "it is read only with dynamic context parallelism"),
            warn("*.megatron.override_transformer_config.context_parallel_algo", "it is read only with context "
                 "parallelism"),
            warn("*.torchtitan.data_parallel_size", "lathe's data parallelism spans all the trainer's devices",
                 _devices_or_all),
            warn("*.megatron.override_transformer_config.*pipeline*", STAGES),
            inert("*.megatron.*sequence_parallel", "Megatron's sequence parallelism splits the norms' activations "
                  "over a tensor-parallel group; lathe's keeps them whole on each rank of the group (more memory, "
                  "the same numbers)"),
            inert("*.megatron.*use_distributed_optimizer", "FSDP2 always shards the optimizer state over the "
                  "devices"),
            inert("*.megatron.use_megatron_fsdp", "lathe always shards with FSDP2"),
            warn("*.veomni.enable_full_shard", "lathe always shards parameters, gradients and optimizer state "
                 "(FSDP2)")]
    return out


def _moe_and_quantization() -> list[Entry]:
    out = [refuse("*.router_replay.mode", ROUTER_REPLAY, "set it to disabled", one_of("disabled")),
           warn("*.router_replay.*", "it is read only with router_replay.mode other than disabled"),
           refuse("*.qat.enable", QAT),
           warn("*.qat.*", "it is read only with qat.enable=true"),
           *_fp8(),
           refuse("*.megatron.override_transformer_config.*fp8*", FP8, "remove it"),
           *_moe_router(),
           warn("*.megatron.override_transformer_config.moe_*", "a MoE kernel or dispatch setting (grouped GEMM, "
                "permute fusion, token dispatcher, DeepEP, router dtype); " + KERNELS)]
    return out


OTC = "*.megatron.override_transformer_config"
A_OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
FP8_KEY = "actor_rollout_ref.actor.fsdp_config.fp8_training"


def _fp8() -> list[Entry]:
    """Megatron's FP8 training keys (Transformer Engine): the actor's fp8=hybrid translates to lathe's torchao path
    (verl_translate); what that path has no equivalent for is refused with the reason."""
    return [
        refuse(f"{A_OTC}.fp8", f"{FP8} with e4m3 gradients (torchao's per-tensor recipe keeps gradients in "
               "e5m2, as Megatron's hybrid does)", f"set it to hybrid (translated: {FP8_KEY}=tensorwise), or remove "
               f"it and set {FP8_KEY}=rowwise (e4m3 throughout, a scale per row)",
               one_of(None, False, "hybrid")),
        warn("actor_rollout_ref.ref.megatron.override_transformer_config.*fp8*", "the reference runs forward only, "
             f"in bf16 (lathe trains only the actor's linear layers in FP8: {FP8_KEY})"),
        refuse(f"{A_OTC}.fp8_recipe", f"{FP8} with Megatron's blockwise / MXFP8 recipes (lathe's is torchao's "
               "float8, with scales per tensor or per row)", f"set it to tensorwise (or remove it: Megatron's "
               f"delayed also runs as torchao's per-tensor dynamic scaling), or set {FP8_KEY}=rowwise instead",
               one_of(None, "tensorwise", "delayed")),
        inert(f"{A_OTC}.fp8_amax_*", "delayed scaling's amax-history settings; lathe's FP8 training scales each "
              "tensor by its current amax"),
        inert(f"{A_OTC}.fp8_margin", "delayed scaling's margin; lathe's FP8 training scales each tensor by its "
              "current amax"),
        inert(f"{A_OTC}.fp8_interval", "delayed scaling's update interval; lathe's FP8 training scales each tensor "
              "by its current amax"),
        refuse(f"{A_OTC}.fp8_wgrad", f"{FP8} with high-precision weight gradients (Megatron's "
               "fp8_wgrad=false) beside per-tensor scales", "remove it (FP8 weight gradients), or remove it and "
               f"fp8=hybrid and set {FP8_KEY}=rowwise_with_gw_hp (the weight gradient's product in bf16, the others "
               "in FP8 with a scale per row)",
               one_of(None, True)),
        refuse(f"{A_OTC}.fp8_param*", f"{FP8} with FP8 parameters (weights stored and gathered in FP8)", "remove it: lathe "
               "keeps the weights in bf16/fp32 and casts them at each forward")]


AUX_ON = "actor_rollout_ref.model.override_config.output_router_logits"


def _aux_on(cfg: Any) -> bool:
    """transformers' load-balancing loss is on (`lathe.models.moe`)."""
    return bool(cfg.actor_rollout_ref.model.override_config.get("output_router_logits"))


def _balancing_type_ok(value: Any, cfg: Any) -> bool:
    """Megatron's default `aux_loss` is the switch loss `moe_aux_loss_coeff` weighs (translated to the actor's);
    `none` asks for no load-balancing loss, so neither that coefficient nor transformers' loss may be on."""
    if value in (None, "aux_loss"):
        return True
    return value == "none" and not _aux_on(cfg) and not cfg.actor_rollout_ref.actor.moe_aux_loss_coeff


def _bias_frozen(cfg: Any) -> bool:
    """Every role that sets Megatron's expert-bias update rate sets it to 0 (and one does)."""
    rates = [v for k, v in _leaves(cfg.verl_keys) if k.endswith(".moe_router_bias_update_rate")]
    return bool(rates) and all(r == 0 for r in rates)


def _moe_router() -> list[Entry]:
    """Megatron's router training settings: what lathe's MoE layers compute the same, and what they do not have."""
    return [
        # the actor's are translated (verl_translate: actor.moe_aux_loss_coeff / moe_z_loss_coeff); the reference
        # trains nothing and a critic's router losses are not built
        refuse(f"{OTC}.moe_aux_loss_coeff", MOE_LOSSES, "remove it (or set it to 0): only the actor's router losses "
               "are built (the reference has no loss)"),
        refuse(f"{OTC}.moe_z_loss_coeff", MOE_LOSSES, "remove it (or set it to 0): only the actor's router losses "
               "are built"),
        refuse(f"{OTC}.moe_*loss*", MOE_LOSSES, "remove it (or set it to 0)"),
        refuse(f"{OTC}.moe_router_load_balancing_type", MOE_LOSSES, "set it to aux_loss (Megatron's default: the "
               "switch loss per sparse layer that moe_aux_loss_coeff weighs) or none (then with no moe_aux_loss_coeff "
               f"and {AUX_ON} unset); Megatron's seq_aux_loss, global_aux_loss and sinkhorn balancing are not "
               "lathe's", ok=_balancing_type_ok),
        # an expert bias that never updates is the router's bias as loaded (DeepSeek-V3's e_score_correction_bias)
        # or none: what lathe's MoE layers compute
        refuse(f"{OTC}.moe_router_enable_expert_bias", MOE_LOSSES, "remove it, or set moe_router_bias_update_rate=0 "
               "beside it (the bias then stays as the checkpoint has it, as lathe's layers use it): lathe does not "
               "update an expert bias from the routing counts (aux-loss-free balancing)",
               ok=lambda v, cfg: not v or _bias_frozen(cfg)),
        refuse(f"{OTC}.moe_router_bias_update_rate", MOE_LOSSES, "set it to 0, or remove it: lathe does not update an "
               "expert bias from the routing counts (aux-loss-free balancing)", ok=lambda v, cfg: v in (None, 0)),
        refuse(f"{OTC}.moe_router_*bias*", MOE_LOSSES, "remove it")]


def _backends() -> list[Entry]:
    otc = "*.megatron.override_transformer_config"
    out = [inert("actor_rollout_ref.ref.megatron.override_transformer_config.recompute_*", "the reference runs "
                 "forward only"),
           replace(inert(f"{otc}.recompute_method", RECOMPUTE_DOC), judge=_per_key(_recompute_judge)),
           replace(inert(f"{otc}.recompute_num_layers", RECOMPUTE_DOC), judge=_per_key(_recompute_judge)),
           warn(f"{otc}.recompute_*", "lathe recomputes whole decoder layers (enable_gradient_checkpointing, "
                "gradient_checkpointing_layers), never parts of one"),
           warn(f"{otc}.*", "a Megatron TransformerConfig setting (fusions, kernels, attention backend); "
                + KERNELS),
           warn("*.megatron.override_ddp_config*", "a Megatron DDP setting; lathe shards with FSDP2"),
           warn("*.megatron.override_mcore_model_config*", "a Megatron model setting; " + KERNELS),
           warn("*.megatron.grad_offload", "lathe keeps gradients only during an update; param_offload and "
                "optimizer_offload are its offload switches"),
           # Megatron Lite's engine group (verl_keys.MLITE_ENGINE; its sizes, offload and recompute translate)
           warn("*.engine.grad_offload", "lathe keeps gradients only during an update; param_offload and "
                "optimizer_offload are its offload switches"),
           warn("*.engine.attention_backend_override", "an attention-kernel choice; " + KERNELS),
           inert("*.engine.impl_cfg.use_thd", "lathe packs sequences (the THD layout) when model.use_remove_padding "
                 "is set; " + SAME_MATH),
           warn("*.engine.impl_cfg.optimizer", "Megatron Lite's optimizer wrapper (fsdp2 or dist_opt); lathe runs "
                "its AdamW over FSDP2 shards, the same update"),
           inert("actor_rollout_ref.ref.engine.impl_cfg.recompute", "the reference runs forward only"),
           warn("*.engine.impl_cfg*", "a Megatron Lite engine setting (kernels, fusions, overlap); " + KERNELS),
           *_dist_checkpointing(),
           warn("*.megatron.*mbridge", CKPT_FORMAT),
           refuse("*.veomni.load_checkpoint_path", "loading a VeOmni checkpoint",
                  "resume a lathe checkpoint with trainer.resume_mode / trainer.resume_from_path"),
           warn("*.veomni.ckpt_manager", CKPT_FORMAT),
           warn("*.activation_gpu_limit", "lathe's activation offload (model.enable_activation_offload) moves every "
                "saved activation of at least 1 MiB, with no device budget"),
           warn("*.veomni.*", "a VeOmni engine setting (kernel implementations, initialisation, prefetch, "
                "compilation); " + KERNELS),
           warn("*.torchtitan.*", "a torchtitan engine setting (attention type, compilation, wrapping, "
                "prefetch); " + KERNELS),
           warn("*.turbo_config*", "verl's Turbo FSDP engine settings; lathe shards with FSDP2 by itself"),
           inert("*.megatron.use_remove_padding", "lathe packs sequences when model.use_remove_padding is set; "
                 + SAME_MATH),
           inert("*.pad_bshd_to_minibatch_max", SAME_MATH), inert("*.pad_to_length", SAME_MATH),
           inert("*.pad_to_length_bucket", SAME_MATH),
           inert("*.forward_only", "verl sets it for roles that only run forward; lathe knows which they are"),
           inert("*.strategy", "lathe trains every backend with its FSDP2 trainer"),
           warn("*.seed", "lathe seeds every worker from trainer.seed", same_as("trainer.seed")),
           warn("*.full_determinism", "lathe does not switch torch to deterministic algorithms"),
           warn("*.entropy_*", ENTROPY),
           warn("*.forward_prefetch", "FSDP2 prefetches the next layer's gather by itself"),
           warn("*.use_orig_params", "an FSDP1 setting; FSDP2 always keeps the original parameters"),
           warn("*.wrap_policy*", "lathe shards each decoder layer and the root, whatever the policy"),
           warn("*.reshard_after_forward", "a sharding setting of the engine lathe does not run")]
    return out


def _per_key(factory):
    """A judge that needs the concrete key a pattern matched: ``entry_for`` calls ``factory(key)``."""
    factory.per_key = True
    return factory


RECOMPUTE_DOC = ("translated beside recompute_granularity=full: block -> the model's gradient_checkpointing_layers = "
                 "recompute_num_layers x the pipeline stages (the first layers recompute, the rest keep their "
                 "activations); uniform -> every layer recomputed (enable_gradient_checkpointing), one layer at a "
                 "time")


def _recompute_judge(key: str):
    """Megatron's recompute_method / recompute_num_layers: translated beside recompute_granularity=full (block, and
    uniform of one layer: every layer, lathe's whole recompute); uniform chunks of several layers recompute every
    layer too, one at a time (each layer's input kept, where Megatron keeps each chunk's); without full granularity
    Megatron does not read them, with actor_rollout_ref.model.impl=hf lathe recomputes no layer, and a count set on
    lathe's key (a saved config.yaml holds the translated one) wins over another that they would give."""
    role = key.split(".megatron.")[0]

    def judge(value, cfg) -> tuple[str, str] | None:
        given = megatron_recompute(cfg, role)
        if value is None:
            return None
        if given["granularity"] != "full":
            return "warn", (f"`{key}`={show(value)} has no effect in lathe: Megatron reads it only beside "
                            f"{role}.{RECOMPUTE}granularity=full.")
        if cfg.actor_rollout_ref.model.impl == "hf":
            return "warn", (f"`{key}`={show(value)} has no effect in lathe: actor_rollout_ref.model.impl=hf trains "
                            "through transformers, which lathe runs without recomputing layers.")
        group = TRAINED_MODEL.get(role)
        count = get_path(cfg, f"{group}.gradient_checkpointing_layers") if group else None
        megatron = block_recompute_layers(cfg, role) if given["method"] == "block" else None
        if count is not None and count != megatron:
            return "warn", (f"`{key}`={show(value)} has no effect in lathe: {group}.gradient_checkpointing_layers="
                            f"{count} is set, and lathe's own count wins over Megatron's recompute keys. Fix: remove "
                            "one of them.")
        if given["method"] == "uniform" and key.endswith("num_layers") and given["num_layers"] != 1:
            return "warn", (f"`{key}`={show(value)} with recompute_method=uniform: Megatron's recompute of chunks of "
                            f"{show(value)} layers runs as lathe's recompute of every layer, one layer at a time (the "
                            "same forwards; each layer's input is kept where Megatron keeps each chunk's).")
        return None
    return judge


REF_START = "a reference model that starts from other weights than the actor"
SAME_START = ("give actor_rollout_ref.ref.megatron the actor's use_dist_checkpointing, dist_checkpointing_path and "
              "dist_checkpointing_prefix: lathe's reference copies the actor's starting weights")


def _same_start(value: Any, cfg: Any) -> bool:
    """The reference (when one is computed) starts from the actor's weights, as lathe's reference copies them as
    loaded: both read the same Megatron checkpoint, or neither does."""
    given = {(None, "") if dist_checkpoint(cfg, role) is None else
             (dist_checkpoint(cfg, role).rstrip("/"), dist_checkpoint_prefix(cfg, role))
             for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")}
    return not needs_ref(cfg) or len(given) == 1


@_per_key
def _dist_judge(key: str):
    """The actor's and the reference's switches act when they agree (`_same_start`); the actor's is judged only while
    the reference's is unset (verl's reference would then start from model.path's Hugging Face weights)."""
    def judge(value: Any, cfg: Any) -> tuple[str, str] | None:
        if _same_start(value, cfg) or (key.startswith("actor_rollout_ref.actor.")
                                       and "actor_rollout_ref.ref.megatron.use_dist_checkpointing" in cfg.verl_keys):
            return None
        return "refuse", f"`{key}`={show(value)}: {REF_START} is not implemented yet in lathe. Fix: {SAME_START}."
    return judge


def _dist_checkpointing() -> list[Entry]:
    """verl's megatron.use_dist_checkpointing / dist_checkpointing_{path,prefix}: the actor's act
    (`lathe.models.megatron_ckpt` reads the checkpoint into lathe's decoder, `verl_translate.dist_checkpoint`); the
    reference's must agree with them; the critic's stay refused."""
    actor, ref = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron"
    acts = ("acts: with dist_checkpointing_path, the actor's (and the reference's) starting weights are read from "
            "that Megatron distributed checkpoint, the architecture from actor_rollout_ref.model.path's config.json; "
            "the reference's keys must say the same as the actor's (it copies the actor's starting weights)")
    return [replace(inert(f"{actor}.use_dist_checkpointing", acts), judge=_dist_judge),
            replace(inert(f"{ref}.use_dist_checkpointing", acts), judge=_dist_judge),
            warn(f"{actor}.dist_checkpointing_p*", "it is read only with actor_rollout_ref.actor.megatron."
                 "use_dist_checkpointing=true, as in verl",
                 ok=lambda v, cfg: v in (None, "") or dist_checkpoint(cfg) is not None),
            warn(f"{ref}.dist_checkpointing_p*", "it is read only with actor_rollout_ref.ref.megatron."
                 "use_dist_checkpointing=true, as in verl",
                 ok=lambda v, cfg: v in (None, "") or dist_checkpoint(cfg, "actor_rollout_ref.ref") is not None),
            refuse("*.megatron.use_dist_checkpointing", "loading a Megatron distributed checkpoint into the critic",
                   "convert the checkpoint to Hugging Face format and set critic.model.path to it"),
            warn("critic.megatron.dist_checkpointing_p*", "it is read only with critic.megatron.use_dist_checkpointing"
                 "=true (refused)",
                 ok=lambda v, cfg: v in (None, "") or cfg.verl_keys.get(f"critic.{DIST_USE}") is True),
            warn("*.megatron.dist*", "it is read only with megatron.use_dist_checkpointing")]


def _optim() -> list[Entry]:
    schedule = ("use optim.lr_scheduler_type (or Megatron's lr_decay_style), lr_warmup_steps(_ratio), lr_warmup_init, "
                "lr_decay_steps and min_lr (or min_lr_ratio)")
    out = [inert("actor_rollout_ref.ref.optim.*", "the reference does not train"),
           refuse("*.optim.name", "an optimizer named by optim.name (lathe reads optim.optimizer)",
                  "set optim.optimizer={value} (a class of optim.optimizer_impl) instead",
                  lambda v, cfg: str(v).lower() in ("adam", "adamw")),
           refuse("*.optim.lr_min", "VeOmni's learning-rate floor key", "set optim.min_lr={value} (the floor the "
                  "decay ends at) instead"),
           refuse("*.optim.min_lr_factor", "a minimum learning-rate factor of this optimizer config",
                  "set optim.min_lr_ratio instead"),
           refuse("*.optim.lr_start", "VeOmni's warm-up start key", "set optim.lr_warmup_init={value} (the rate the "
                  "warm-up starts from) instead"),
           refuse("*.optim.lr_decay_ratio", "a decay over part of the run", schedule),
           refuse("*.optim.decay_type", "torchtitan's learning-rate decay key", "set optim.lr_scheduler_type (linear "
                  "or cosine; torchtitan's sqrt has no equivalent) and min_lr_ratio instead"),
           inert("*.optim.weight_decay_incr_style", "verl hands Megatron's scheduler one weight decay as its start "
                 "and end, so no style changes it"),
           refuse("*.optim.exp_avg*_dtype", LOW_PRECISION_OPTIM, "set it to fp32"),
           refuse("*.optim.main_grads_dtype", LOW_PRECISION_OPTIM, "set it to fp32"),
           refuse("*.optim.use_precision_aware_optimizer", LOW_PRECISION_OPTIM),
           warn("*.optim.muon_*", "it is read only by the Muon optimizer (not in lathe)"),
           warn("*.optim.use_checkpoint_opt_param_scheduler", "lathe always resumes the schedule from its "
                "checkpoint"),
           warn("*.optim.use_layer_wise_distributed_optimizer", "FSDP2 shards the optimizer state by itself")]
    return out


def _models() -> list[Entry]:
    lora = "verl's Megatron-style LoRA group"
    out = [refuse("*.model.lora.type", "a LoRA variant other than lora", "set it to lora", one_of("lora")),
           warn("*.model.lora.*", f"{lora}: lathe's LoRA takes model.lora_rank, lora_alpha, target_modules (Hugging "
                "Face module names) and exclude_modules"),
           refuse("*.mtp.enable*", MTP, "set it to false"),
           warn("*.mtp.*", "it is read only with mtp.enable=true"),
           warn("*.model.tiled_mlp.*", "lathe does not tile the MLP (a memory saving with the same result)"),
           refuse("critic.model.hf_config_path", "reading the model config from a separate path",
                  "remove it; keep config.json with the weights in critic.model.path"),
           warn("critic.model.custom_chat_template", "the critic reads the policy's tokens"),
           warn("critic.model.exclude_modules", "critic LoRA is not implemented"),
           warn("critic.model.lora_adapter_path", "critic LoRA is not implemented"),
           warn("critic.model.use_*", KERNELS), warn("critic.model.fused_kernel_options*", KERNELS)]
    return out


def _roles() -> list[Entry]:
    out = [inert("*.rollout_n", "verl copies rollout.n here; lathe reads rollout.n"),
           inert("*.calculate_entropy", "lathe's actor reports entropy whether or not it is in the loss"),
           warn("*.calculate_sum_pi_squared", "it is read only by advantage estimators lathe does not have"),
           warn("*.use_prefix_grouper", "actor.use_prefix_grouper groups the actor's and the reference's passes"),
           warn("*.policy_loss.dro_beta", "it is read only by a policy loss lathe does not have"),
           warn("*.checkpoint.strict", "lathe always loads its checkpoints strictly"),
           warn("*.checkpoint.mbridge_config*", CKPT_FORMAT),
           warn("critic.loss_scale_factor", "lathe's value loss is averaged over the response tokens"),
           warn("critic.nccl_timeout", "lathe's collectives use actor_rollout_ref.nccl_timeout")]
    return out


def _data() -> list[Entry]:
    return [warn("data.image_patch_size", "lathe takes the patch size from the model's image processor"),
            refuse("data.audio_key", "audio prompts", "remove it (or set it back to {default})"),
            warn("data.function_tool_path", "lathe measures prompts with the tools of "
                 "rollout.multi_turn.tool_config_path"),
            refuse("data.mm_processor_kwargs*", "processor arguments for images and videos",
                   "remove it; lathe calls the model's processor with its own settings")]


def _rewards() -> list[Entry]:
    custom = "remove it; score with reward.custom_reward_function.path (lathe's one reward manager calls it)"
    served = ("lathe's reward model (a transformers forward, or a judge on lathe's engine) runs on the trainer's "
              "devices, or on reward_model.nnodes x reward_model.n_gpus_per_node devices of its own with "
              "enable_resource_pool, not on an inference server of its own (reward.reward_model.enable, model_path "
              "and enable_resource_pool are reward_model.enable, reward_model.model.path and "
              "reward_model.enable_resource_pool)")
    judge_engine = ("a generative judge (reward_model.judge.enable) runs on lathe's engine, set by the fields of "
                    "reward_model.rollout (sampling, lengths, memory, graphs, caching; reward.reward_model.rollout is "
                    "the same group); lathe's engine has no counterpart for this one, and a sequence-classification "
                    "reward model does not read the group")
    return [warn("reward.reward_model.rollout.*", judge_engine), warn("reward.reward_model.*", served),
            refuse("reward.reward_manager.source", "a reward manager loaded from a module", custom,
                   one_of("register")),
            refuse("reward.reward_manager.module.path", "a custom reward-manager class", custom),
            warn("reward.reward_manager.module.*", "it is read only with reward_manager.source=importlib"),
            refuse("reward_model.reward_loop_*", "a custom reward loop", custom),
            warn("reward_model.rollout.*", judge_engine)]


def _runs() -> list[Entry]:
    return [warn("transfer_queue.*", "lathe moves batches between its workers itself"),
            refuse("skip.*.enable", "replaying dumped rollouts instead of generating (skip_rollout)"),
            warn("skip.*", "it is read only with skip.<stage>.enable=true"),
            warn("algorithm.filter_groups.max_inflight_gen_batches", "lathe generates the filter_groups batches "
                 "one after another"),
            warn("global_profiler.*", "it is for the nsys/npu profilers' finishing hooks; lathe writes torch "
                 "traces and memory snapshots only")]


# ----------------------------------------------------------------------------- judges of lathe's own keys
# (support.py's registry uses them: verl's backend choice, and Megatron settings inside lathe's keys)

BACKEND_NOTE = ("the backend's keys lathe has an equivalent for are translated (offload, recomputation, dtype, "
                "tensor-, context- and expert-parallel sizes; pipeline-parallel sizes run as FSDP sharding over those "
                "devices), its kernel and fusion switches have no effect")
BACKEND = "lathe trains every backend with its FSDP2 trainer: " + BACKEND_NOTE


def backend_judge(key: str):
    """verl's megatron/veomni/torchtitan backend: one notice for the backend a run names (model_engine first,
    then the actor's strategy; the reference's and critic's add one only when they name another)."""
    def judge(value, cfg) -> tuple[str, str] | None:
        named = [cfg.model_engine] if key != "model_engine" else []
        if key == "actor_rollout_ref.actor.strategy":       # one notice when the actor's model_engine names it too
            named.append(cfg.actor_rollout_ref.actor.model_engine)
        if key in ("actor_rollout_ref.ref.strategy", "critic.strategy"):
            named.append(cfg.actor_rollout_ref.actor.strategy)
        if value in (None, "fsdp", "fsdp2", "dp") or value in named:
            return None
        return "warn", f"`{key}`={show(value)} runs on lathe's FSDP2 trainer: {BACKEND_NOTE}."
    return judge


FEATURES = {
    "verl backends: parallel sizes": _parallel,
    "verl backends: MoE, QAT and FP8": _moe_and_quantization,
    "verl backends: engine settings": _backends,
    "verl optimizer and learning-rate keys (Megatron, Muon)": _optim,
    "verl model groups: LoRA, MTP, tiled MLP; critic model": _models,
    "verl actor/critic options": _roles,
    "verl data keys": _data,
    "verl's reward group and reward loops": _rewards,
    "verl trainer variants, data transfer, rollout replay, profiler hooks": _runs,
}


@functools.lru_cache(maxsize=1)
def patterns() -> tuple[Entry, ...]:
    """Every pattern entry, tagged with its feature heading, in matching order."""
    return tuple(replace(e, feature=f) for f, entries in FEATURES.items() for e in entries())


def entry_for(key: str) -> Entry | None:
    """The entry that judges verl key ``key`` (its own key filled in): its pattern's, else 'translated' for a
    key ``verl_translate`` maps (at a value it does not map, such as verl's default); None when neither."""
    for entry in patterns():
        if fnmatchcase(key, entry.key):
            judge = entry.judge(key) if getattr(entry.judge, "per_key", False) else entry.judge
            return replace(entry, key=key, judge=judge)
    translated = rule_for(key)
    if translated is not None:
        return Entry(key, "inert", f"translated: {translated[1]}", feature="translated")
    return None


def _leaves(held: dict[str, Any]) -> list[tuple[str, Any]]:
    """The held keys, a mapping held for a verl group (a resolved ${...} reference to one) taken key by key."""
    out = []
    for key, value in held.items():
        if isinstance(value, dict) and value and is_verl_group(key):
            out += _leaves({f"{key}.{k}": v for k, v in flatten(value).items()})
        else:
            out.append((key, value))
    return out


def judge_verl_keys(cfg: Any) -> list[tuple[str, str]]:
    """(kind, message) for each key of ``cfg.verl_keys`` that is refused or has no effect."""
    out = []
    for key, value in _leaves(cfg.verl_keys):
        if not is_verl_key(key):
            out.append(("refuse", f"Unknown config key `{key}` in verl_keys: it is not one of verl's keys. Fix: "
                                  "remove it (verl_keys holds the verl keys lathe has no field for)."))
            continue
        verdict = verdict_for(key, value, cfg)
        if verdict is not None:
            out.append(verdict)
    notices = (tp_beside_ep_notice(cfg),       # once for every role whose Megatron TP beside EP was dropped
               pipeline_notice(cfg),          # once for every role whose pipeline-parallel size was set
               context_parallel_notice(cfg),  # once for the padded forwards a context-parallel size packs
               lora_experts_notice(cfg))      # once for Megatron LoRA beside EP (the routed experts stay frozen)
    return out + [("warn", notice) for notice in notices if notice is not None]


def verdict_for(key: str, value: Any, cfg: Any) -> tuple[str, str] | None:
    """(kind, message) when verl key ``key``'s value is refused or has no effect; None when it is translated
    (set on lathe's key as it was given) or fine as it is."""
    if translate(key, value):
        return None
    default = verl_default(key) if key in verl_defaults() else None     # below a free map: nothing is set
    if value in ({}, []) and default is None:
        return None                                                       # an empty free map (verl's default)
    entry = entry_for(key) or Entry(key, "warn", "lathe does not read this verl key")
    return entry.verdict(value, default, cfg)


def verl_note(key: str) -> str:
    """Help for a verl key lathe has no field for ('' for other keys)."""
    if not is_verl_key(key):
        return ""
    head = f"verl's key (verl's default: {show(verl_default(key))})." if key in verl_defaults() else "verl's key."
    translated = rule_for(key)
    if translated is not None:
        return f"{head} lathe sets {translated[0]} from it ({translated[1]}); at verl's default it sets nothing."
    entry = entry_for(key)
    return f"{head} {entry.note()}" if entry else head


def markdown_lines() -> list[str]:
    """The patterns' section of docs/config_keys.md."""
    label = {"refuse": "refused", "warn": "no effect", "inert": "same either way"}
    lines = ["# verl keys lathe has no field for", "",
             "lathe knows every key of verl's generated trainer configs (`src/lathe/config/verl_keys.yaml`). Those "
             "without a field in lathe's tree are judged by pattern (`*` spans dots; the first match wins), "
             "against verl's default. Translated (`src/lathe/config/verl_translate.py`): " + "; ".join(
                 f"`{p}` -> {d}" for p, _, _, d in RULES) + "; `model.lora.{rank,alpha,dropout,adapter_path}` -> "
             "`model.lora_*`. A translated key at verl's default sets nothing.", ""]
    for feature in FEATURES:
        lines += [f"## {feature}", "", "| pattern | status | why / fix |", "| --- | --- | --- |"]
        for e in (e for e in patterns() if e.feature == feature):
            fix = e.format(e.fix, None, None, shown="<value>").replace("null", "verl's default")
            why = f"{e.text}; fix: {fix}" if e.kind == "refuse" else e.text
            lines.append(f"| `{e.key}` | {label[e.kind]} | {why.replace('|', '/')} |")
        lines.append("")
    return lines

