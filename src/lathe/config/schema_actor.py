"""Config groups for the policy model, the actor's PPO update and the reference policy.

Key names and defaults follow verl's ``actor_rollout_ref.{model,actor,ref}`` groups. Keys that
lathe accepts so verl launch scripts run unchanged, but does not act on yet, say so in their help.
A default of ``None`` that "falls back" to another key is filled in by ``load_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .choices import (CheckpointPart, DtypeName, Fp8Recipe, FSDPStrategy, KLEstimator, LossAggMode, MegatronSchedule,
                      ScheduleName, Strategy, WSDDecay)
from .coerce import spec


# a model group's gradient_checkpointing_layers (the actor's, the critic's, lathe sft's)
RECOMPUTE_LAYERS_HELP = (
    "lathe: how many decoder layers recompute under enable_gradient_checkpointing: the first N (Megatron's "
    "recompute_method=block, recompute_num_layers=N; the first layers' activations live longest), the others keep "
    "their activations and skip the second forward, so a model whose activations almost fit recomputes only what it "
    "must. null = every layer; 0 = none; more than the model has = every layer. Needs "
    "enable_gradient_checkpointing=true; lathe's decoder only (a transformers model refuses it).")


@dataclass
class MixedPrecisionConfig:
    """verl's ``fsdp_config.mixed_precision``: FSDP2 ``MixedPrecisionPolicy`` semantics (on CUDA; CPU runs fp32)."""

    param_dtype: DtypeName = spec("bf16", "Dtype the model computes in (forward and backward): bf16 or fp32. The weights "
                                    "the optimizer updates stay in model_dtype.")
    reduce_dtype: DtypeName = spec("fp32", "Dtype gradients are accumulated (and, on many devices, reduced) in: fp32 or "
                                     "bf16.")
    buffer_dtype: DtypeName = spec("fp32", "Dtype of model buffers; lathe keeps its only buffers (rotary frequencies) in "
                                     "fp32, so only fp32 is accepted.")


@dataclass
class FSDPConfig:
    """verl's ``fsdp_config`` group: precision, sharding and offload switches for one model.

    On one CUDA device lathe trains as FSDP2's mixed precision does (``lathe.train.precision``): the module
    computes in ``mixed_precision.param_dtype`` (bf16) while the optimizer updates ``model_dtype`` (fp32)
    master weights, with gradients accumulated in ``reduce_dtype``. A frozen model (the reference) holds
    ``param_dtype`` weights only.
    """

    param_offload: bool = spec(False, "Keep parameters on CPU between uses: the actor's/critic's fp32 master weights "
                                      "(streamed through the GPU by the optimizer step); the reference's weights "
                                      "(moved in for each log-prob pass). Needs CUDA and mixed precision.")
    optimizer_offload: bool = spec(False, "Keep the optimizer state (AdamW moments) in pinned CPU memory; the step "
                                          "streams it through the GPU in chunks. On several devices (FSDP2) each rank "
                                          "keeps its own shards' moments there, the shards and gradients staying on "
                                          "the GPU (with param_offload, FSDP2 offloads all three). Needs CUDA.")
    offload_policy: bool = spec(False, "FSDP2 CPU offload policy for param/grad/optimizer.")
    grad_offload: bool = spec(False, "Old verl key: gradient offload.")
    reshard_after_forward: bool = spec(True, "FSDP2: free gathered params after forward.")
    keep_gathered: bool | None = spec(
        None, "lathe: keep each layer's FSDP2-gathered weights across the micro-batches of a mini-batch (and of a "
              "forward-only pass) and accumulate the gradients unsharded, so a mini-batch gathers the weights once "
              "and reduce-scatters the gradients once instead of once per micro-batch (lathe.train.gathered); costs "
              "the whole weights + gradients on each device during the update (6 bytes a parameter in bf16 mixed "
              "precision). null: on with CUDA when that is at most 15% of the device's memory and the weights are "
              "not offloaded; true/false: always/never. Acts only with several devices.")
    fsdp_size: int = spec(-1, "Devices per FSDP shard group. -1 (or the device count): every weight sharded over all "
                              "the trainer's devices; N dividing the devices: hybrid sharding (HSDP), shards over "
                              "groups of N devices, replicated across devices / N groups (N = 1: a whole copy on "
                              "each device); the batch is split over all devices either way.")
    tensor_parallel_size: int = spec(1, "lathe (torchtitan's name; verl's megatron.tensor_model_parallel_size and "
                                        "torchtitan.tensor_parallel_size set it): groups of this many consecutive "
                                        "devices of a node hold 1/size of each decoder layer (column-parallel q/k/v, "
                                        "gate/up; row-parallel o/down), of the embeddings and of the lm_head's "
                                        "vocabulary, and compute each micro-batch together (lathe.train."
                                        "tensor_parallel); FSDP2 shards over the devices / size data-parallel "
                                        "ranks (fsdp_size counts those). It must divide the devices of a node and "
                                        "the model's heads, key/value heads and intermediate size. "
                                        "1: off.")
    expert_parallel_size: int = spec(1, "lathe (torchtitan's name; verl's megatron.expert_model_parallel_size, "
                                        "torchtitan.expert_parallel_size and veomni.expert_parallel_size set it): "
                                        "groups of this many consecutive data-parallel devices each hold "
                                        "num_experts / size whole experts of every mixture-of-experts layer, tokens "
                                        "dispatched to their experts' owners by all-to-all (lathe.train."
                                        "expert_parallel); FSDP2 shards the experts over the devices / size groups "
                                        "only. It must divide the FSDP shard group (fsdp_size) and the model's "
                                        "num_experts; not with tensor parallelism, Ulysses or LoRA. 1: off.")
    forward_prefetch: bool = spec(False, "Prefetch the next all-gather during forward.")
    model_dtype: DtypeName = spec("fp32", "Dtype of the weights the optimizer updates (master weights): fp32 or bf16 "
                                    "(bf16 = pure bf16 training). A frozen reference holds param_dtype weights.")
    mixed_precision: MixedPrecisionConfig = spec(factory=MixedPrecisionConfig,
                                                 help="Compute / gradient dtypes (FSDP2 MixedPrecisionPolicy).")
    use_orig_params: bool = spec(False, "FSDP1 use_orig_params (verl).")
    wrap_policy: dict[str, Any] = spec({"min_num_params": 0}, "Module wrapping policy (verl).")
    strategy: FSDPStrategy | None = spec(None, "Engine strategy override (verl: fsdp|fsdp2).")
    use_torch_compile: bool = spec(True, "verl's engine-worker switch: false runs this model eager. On CUDA, "
                                         "lathe compiles its decoder layers (and the actor's log-prob math).")


@dataclass
class ActorFSDPConfig(FSDPConfig):
    """The actor's ``fsdp_config``: the shared switches, plus what only the trained policy has."""

    fp8_training: Fp8Recipe | None = spec(
        None, "lathe (verl's megatron.override_transformer_config.fp8=hybrid with fp8_recipe=tensorwise sets it to "
              "tensorwise): train the policy's decoder-layer projections in FP8 through torchao's float8 "
              "(lathe.train.fp8; pip install 'lathe[fp8]'). tensorwise: one dynamic scale per tensor, e4m3 forward "
              "and e5m2 gradients (at 7B the update 1.24x bf16); rowwise: a scale per row, e4m3 throughout, more "
              "accurate, slower; rowwise_with_gw_hp: row-wise scales, the weight gradient's product in bf16 (below "
              "7B the faster: the 1.5B update 1.04x, 0.5B even, where tensorwise made 1.02x and 0.92x; 7B 1.14x). The "
              "embeddings, lm_head, routers, routed experts and layers too small for FP8 to pay (torchao's thresholds) "
              "stay bf16, and so do the weights, optimizer and checkpoints; the reference, rollout and critic compute in bf16. Needs an NVIDIA GPU of compute "
              "capability 8.9 or later (Ada, Hopper); not with LoRA or tensor parallelism. With it the rollout's "
              "log-probs differ more from the trainer's: token-level TIS turns on unless "
              "algorithm.rollout_correction is configured (rollout.quantization_correction=false: off). null: "
              "bf16.")


@dataclass
class CheckpointConfig:
    """What a checkpoint holds (verl ``checkpoint``)."""

    save_contents: list[CheckpointPart] = spec(["model", "optimizer", "extra"],
                                    "Parts to save: model, optimizer, extra (rng, step), hf_model.")
    load_contents: list[CheckpointPart] = spec(["model", "optimizer", "extra"], "Parts to load on resume.")
    async_save: bool = spec(False, "Save in the background (verl).")


@dataclass
class OptimConfig:
    """AdamW and learning-rate schedule (verl ``optim``)."""

    lr: float = spec(1e-6, "Peak learning rate.")
    lr_warmup_steps: int | None = spec(-1, "Warmup steps; <= 0 or null defers to lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = spec(0.0, "Warmup steps as a fraction of the decay steps (lr_decay_steps, by "
                                             "default the run's training steps).")
    min_lr_ratio: float | None = spec(0.0, "Decay floor as a fraction of lr (verl's FSDP key; min_lr is Megatron's).")
    num_cycles: float = spec(0.5, "Number of cosine half-waves over training (0.5 = decay once).")
    lr_scheduler_type: ScheduleName = spec(
        "constant", "LR schedule after warmup: verl's FSDP constant or cosine, or one of Megatron's (linear, "
                    "inverse_square_root, WSD: lathe takes them here too, as lr_decay_style names them).")
    warmup_style: Literal["constant", "cosine"] | None = spec(
        None, "verl's older name for lr_scheduler_type; when set it wins and is copied there.")
    # Megatron's OptimizerParamScheduler (verl's McoreOptimizerConfig): the same schedule, its own key names
    lr_decay_style: MegatronSchedule | None = spec(
        None, "verl's Megatron name for lr_scheduler_type; when set it wins and is copied there (Megatron's "
              "spelling inverse-square-root too).")
    lr_decay_steps: int | None = spec(None, "Steps the decay spans, warmup included (Megatron); null = the run's "
                                            "training steps. Past them the rate stays at the floor.")
    lr_warmup_init: float = spec(0.0, "The rate the warmup starts from (Megatron).")
    init_lr_ratio: float | None = spec(None, "The rate the warmup starts from as a fraction of lr (verl's cosine "
                                             "schedule's init_lr_ratio, its automodel optimizer's key); null = "
                                             "lr_warmup_init.")
    min_lr: float = spec(0.0, "Decay floor, absolute (Megatron); when above 0 it wins over min_lr_ratio.")
    lr_wsd_decay_style: WSDDecay = spec("exponential", "With lr_scheduler_type=WSD: the shape of the final "
                                                       "annealing (Megatron).")
    lr_wsd_decay_steps: int | None = spec(None, "With lr_scheduler_type=WSD: the annealing's steps, the last of "
                                                "lr_decay_steps (Megatron; required by WSD).")
    zero_indexed_step: bool = spec(True, "verl's cosine schedule counts steps from 0; false counts from 1 "
                                         "(torchtitan's), the cosine one step ahead.")
    weight_decay: float = spec(0.01, "Decoupled (AdamW) weight decay.")
    betas: list[float] = spec([0.9, 0.999], "Adam betas [beta1, beta2].")
    clip_grad: float | None = spec(None, "verl's newer spelling of grad_clip; when set it wins.")
    total_training_steps: int = spec(-1, "Filled in at runtime from the data size; -1 = not yet known.")
    optimizer: str = spec("AdamW", "Optimizer class name.")
    optimizer_impl: str = spec("torch.optim", "Module the optimizer class is imported from.")
    override_optimizer_config: dict[str, Any] | None = spec(None, "Extra optimizer kwargs.")


@dataclass
class PolicyLossConfig:
    """Which policy-gradient loss to use and its knobs (verl ``policy_loss``)."""

    loss_mode: str = spec("vanilla", "Policy loss name: vanilla (PPO clip), gspo, sapo, cispo, geo_mean, "
                                     "gpg, clip_cov, kl_cov, dppo_tv, dppo_kl, dro, ... (checked by the algo "
                                     "registry).")
    clip_cov_ratio: float = spec(0.0002, "clip_cov: fraction of tokens whose gradient is clipped.")
    clip_cov_lb: float = spec(1.0, "clip_cov: lower bound of the covariance window.")
    clip_cov_ub: float = spec(5.0, "clip_cov: upper bound of the covariance window.")
    kl_cov_ratio: float = spec(0.0002, "kl_cov: fraction of tokens that get the KL penalty.")
    ppo_kl_coef: float = spec(0.1, "kl_cov: KL penalty coefficient.")
    dro_beta: float | None = spec(None, "dro: weight of the quadratic log-ratio penalty; required (> 0) with "
                                        "loss_mode=dro.")


@dataclass
class RouterReplayConfig:
    """MoE routing replay (verl ``actor.router_replay``; lathe.train.routing)."""

    mode: Literal["disabled", "R2", "R3"] = spec(
        "disabled", "R3: the old-log-prob and update forwards route each token to the experts the rollout engine "
                    "chose for it (needs rollout.enable_rollout_routing_replay=true); R2: the old-log-prob forward "
                    "records its routing and the update forwards replay it; disabled: every forward routes itself.")
    record_file: str | None = spec(None, "verl (Megatron): a file to save the recorded routing to.")
    replay_file: str | None = spec(None, "verl (Megatron): a file to replay routing from.")


@dataclass
class MtpConfig:
    """Multi-token prediction (verl ``actor_rollout_ref.model.mtp``): a policy's MTP layers (MiMo's
    ``model.mtp_layers``, lathe.models.mtp) are loaded and saved with the checkpoint whatever these say; those lathe's
    decoder does not run (DeepSeek-V3's, GLM-4.5's, HY-V3's, Qwen3.5's) are saved with ``enable``."""

    enable: bool = spec(False, "verl: use the checkpoint's MTP layers (MiMo's: lathe keeps and saves them either "
                               "way; enable_train and enable_rollout need it). The MTP layers lathe's decoder loads "
                               "but does not run (DeepSeek-V3's, GLM-4.5's, HY-V3's model.layers.<n>, Qwen3.5's and "
                               "Qwen3-Next's mtp.*) are copied unchanged from model.path into every checkpoint the "
                               "policy saves with it, left out without (lathe.train.mtp.keep_checkpoint_mtp).")
    enable_train: bool = spec(False, "verl: train the MTP layers beside the RL loss: their next-next-token "
                                     "cross-entropy over the response tokens, times mtp_loss_scaling_factor "
                                     "(lathe.train.mtp; logged as actor/mtp_losses/mtp_<k>_loss).")
    enable_rollout: bool = spec(False, "verl: speculative decoding in the rollout (with enable): the first MTP layer "
                                       "drafts a chain of tokens, one forward of the policy verifies them, and exact "
                                       "speculative sampling keeps the output distribution and log-probs the "
                                       "policy's (lathe.engine.spec_step; rollout/spec_accept_rate and "
                                       "rollout/spec_accept_length report the drafts' acceptance). Drafts per step: "
                                       "num_speculative_tokens with rollout.name=vllm, else speculative_num_steps.")
    detach_encoder: bool = spec(False, "verl: the MTP loss trains the MTP layers only (no gradient into the main "
                                       "model's hidden states or the token embeddings).")
    mtp_loss_scaling_factor: float = spec(0.1, "verl: the MTP loss's weight (divided over the MTP layers).")
    speculative_algorithm: str = spec("EAGLE", "verl (SGLang): the speculative-decoding algorithm of enable_rollout, "
                                               "read unless rollout.name=vllm: EAGLE or NEXTN (drafting with the MTP "
                                               "layers); others are refused.")
    speculative_num_steps: int = spec(3, "verl (SGLang): draft tokens per verify step of enable_rollout, read unless "
                                         "rollout.name=vllm.")
    speculative_eagle_topk: int = spec(1, "verl (SGLang): draft candidates per step of enable_rollout; lathe verifies "
                                          "one chain: 1 (tree drafts are refused).")
    speculative_num_draft_tokens: int = spec(4, "verl (SGLang): tokens a verify step scores (the last token and the "
                                                "drafts): speculative_num_steps + 1 with topk 1.")
    method: str = spec("mtp", "verl (vLLM): the speculative method of enable_rollout, read with rollout.name=vllm: "
                              "mtp (others are refused).")
    num_speculative_tokens: int = spec(1, "verl (vLLM): draft tokens per verify step of enable_rollout, read with "
                                          "rollout.name=vllm.")


@dataclass
class WarmStartConfig:
    """lathe: supervised warm start on ``extra_info.answer`` before RL (the built-in demos use it): the reply text,
    or the turns that follow the prompt (a list of messages: tool calls, tool answers, the reply), trained as a
    conversation (the assistant turns)."""

    steps: int = spec(0, "Supervised steps before RL; 0 disables the warm start.")
    lr: float = spec(1e-3, "Learning rate of the warm start.")
    batch_size: int = spec(64, "Examples per warm-start step.")
    cache: bool = spec(True, "Keep the warm-started model in lathe's cache ($LATHE_CACHE_DIR, else "
                             "~/.cache/lathe) and reuse it when the same inputs come again.")


@dataclass
class ModelConfig:
    """The policy model (verl ``actor_rollout_ref.model``), shared by actor, ref and rollout."""

    path: str = spec("builtin:tiny", "HF model id or local dir; 'builtin:tiny' = a tiny model built in code.")
    tokenizer_path: str | None = spec(None, "Tokenizer location; null = same as path.")
    hf_config_path: str | None = spec(None, "HF config location; null = same as path.")
    trust_remote_code: bool = spec(False, "Allow model code shipped with the checkpoint.")
    override_config: dict[str, Any] = spec({}, "Keys that override the model's HF config (e.g. attention_dropout).")
    external_lib: str | None = spec(None, "Python module imported before loading (registers custom models).")
    custom_chat_template: str | None = spec(None, "Jinja chat template replacing the tokenizer's.")
    use_shm: bool = spec(False, "Copy the model to shared memory first (verl).")
    impl: Literal["auto", "lathe", "hf"] = spec(
        "auto", "lathe: the implementation that trains actor, reference and critic. auto = lathe's own decoder "
                "for Llama/Qwen2/Qwen3 checkpoints (packed forward, chunked log-probs), transformers for other "
                "architectures; lathe = lathe's decoder or an error; hf = transformers always.")
    enable_gradient_checkpointing: bool = spec(True, "Recompute each decoder layer's activations in backward to "
                                                     "save memory (lathe's decoder; not yet for transformers).")
    gradient_checkpointing_layers: int | None = spec(None, RECOMPUTE_LAYERS_HELP + " MiMo's MTP layers count after "
                                                           "the main stack's.")
    enable_activation_offload: bool = spec(False, "Keep what a training forward saves for its backward "
                                                       "in pinned host memory (CUDA; lathe.train.offload).")
    use_remove_padding: bool = spec(False, "Packed (varlen) forward of actor and reference without pad tokens "
                                           "(lathe's decoder; transformers models run padded).")
    use_liger: bool = spec(False, "Liger kernels (verl).")
    use_fused_kernels: bool = spec(False, "Fused log-prob/entropy kernels (verl).")
    fused_kernel_options: dict[str, Any] = spec({"impl_backend": "torch"}, "Fused kernel options (verl).")
    lora_rank: int = spec(0, "LoRA rank; 0 = full fine-tuning. > 0: only the adapters train, the reference is the "
                             "actor with its adapters off, the engine generates from the merged weights.")
    lora_alpha: int = spec(16, "LoRA alpha (the update is scaled by lora_alpha / lora_rank).")
    target_modules: str | list[str] = spec("all-linear", "LoRA target modules.")
    exclude_modules: str | list[str] | None = spec(None, "Modules excluded from LoRA.")
    lora_adapter_path: str | None = spec(None, "A PEFT LoRA adapter directory (adapter_config.json + "
                                               "adapter_model.safetensors) the adapters start from.")
    lora_dropout: float = spec(0.0, "lathe: dropout on the LoRA branch's input while training.")
    warm_start: WarmStartConfig = spec(factory=WarmStartConfig, help="lathe: supervised warm start before RL.")
    mtp: MtpConfig = spec(factory=MtpConfig, help="verl: multi-token-prediction layers (lathe.train.mtp).")


@dataclass
class ActorConfig:
    """PPO-family policy update (verl ``actor_rollout_ref.actor``).

    Batch units (verl's): ``ppo_mini_batch_size`` counts PROMPTS (x rollout.n sequences, split
    across devices); ``ppo_micro_batch_size_per_gpu`` counts SEQUENCES per device.
    """

    strategy: Strategy = spec("fsdp", "Training backend (verl: fsdp|fsdp2|megatron).")
    model_engine: str | None = spec(None, "verl's examples README's spelling of the top-level model_engine (dp, "
                                          "megatron, veomni, torchtitan): lathe trains each on its FSDP2 trainer.")
    ppo_mini_batch_size: int = spec(256, "Prompts per PPO mini-batch (one optimizer step); x rollout.n sequences.")
    ppo_micro_batch_size: int | None = spec(None, "Deprecated (verl): global micro-batch in sequences; "
                                                  "converted to ppo_micro_batch_size_per_gpu.")
    ppo_micro_batch_size_per_gpu: int | None = spec(
        None, "Sequences per device per forward/backward (gradient accumulation). "
              "null = lathe default: the whole per-device mini-batch in one pass.")
    use_dynamic_bsz: bool = spec(False, "Pack micro-batches by token count instead of sequence count.")
    ppo_max_token_len_per_gpu: int = spec(16384, "Token budget per device micro-batch when use_dynamic_bsz.")
    clip_ratio: float = spec(0.2, "PPO clip epsilon; default for clip_ratio_low/high (loss_mode=dppo_tv/dppo_kl: "
                                  "the TV/KL divergence threshold instead).")
    clip_ratio_low: float | None = spec(None, "Lower clip epsilon (ratio >= 1-low); null = clip_ratio.")
    clip_ratio_high: float | None = spec(None, "Upper clip epsilon (ratio <= 1+high, DAPO clip-higher); "
                                               "null = clip_ratio.")
    clip_ratio_c: float = spec(3.0, "Dual-clip PPO constant c (> 1) bounding the loss for negative advantages "
                                    "(loss_mode=dppo_tv/dppo_kl: the cap of the truncated IS ratio).")
    tau_pos: float = spec(1.0, "SAPO smoothing temperature for positive advantages.")
    tau_neg: float = spec(1.05, "SAPO smoothing temperature for negative advantages.")
    policy_loss: PolicyLossConfig = spec(factory=PolicyLossConfig, help="Policy loss selection.")
    loss_agg_mode: LossAggMode = spec("token-mean", "How token losses become the loss (lathe.algo.aggregate): "
                                                    "token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean "
                                                    "or seq-mean-token-sum-norm.")
    loss_scale_factor: float | None = spec(None, "seq-mean-token-sum-norm divisor; null = response length.")
    entropy_coeff: float = spec(0.0, "Entropy bonus coefficient in the actor loss.")
    use_prefix_grouper: bool = spec(False, "Rows that share a prompt run it once in the actor's forward passes (the "
                                           "old log-probs and the update) and the reference's: each response sees "
                                           "its prompt and itself; same numbers as the per-row forward. lathe's text "
                                           "decoder; replaces use_remove_padding's packed forward for those passes.")
    calculate_sum_pi_squared: bool = spec(False, "The old-log-prob pass also computes each token's sum over the "
                                                 "vocabulary of pi^2 (`sum_pi_squared`), which "
                                                 "adv_estimator=optimal_token_baseline needs.")
    router_replay: RouterReplayConfig = spec(factory=RouterReplayConfig, help="MoE routing replay (R2/R3).")
    moe_aux_loss_coeff: float = spec(
        0.0, "Megatron's switch load-balancing loss for a MoE policy (verl's megatron.override_transformer_config."
             "moe_aux_loss_coeff sets it): per sparse layer E * sum_e f_e P_e (f_e: the layer's share of the top-k "
             "assignments going to expert e; P_e: its mean routing probability), summed over the layers, times this. "
             "0: off.")
    moe_z_loss_coeff: float = spec(
        0.0, "Megatron's router z-loss for a MoE policy (megatron.override_transformer_config.moe_z_loss_coeff sets "
             "it): per sparse layer the mean over tokens of logsumexp(router logits)^2, summed over the layers, times "
             "this. 0: off.")
    use_kl_loss: bool = spec(False, "Add a KL(actor || ref) term to the loss (GRPO style).")
    kl_loss_coef: float = spec(0.001, "Coefficient of the KL loss.")
    kl_loss_type: KLEstimator = spec("low_var_kl", "KL estimator: kl (k1), abs, mse (k2), low_var_kl (k3); a "
                                                   "trailing + (e.g. low_var_kl+) takes k2's gradient.")
    ppo_epochs: int = spec(1, "Passes over each step's batch.")
    shuffle: bool = spec(False, "Each PPO epoch takes the step's sequences in a fresh random order before cutting "
                                "mini-batches (a prompt's rows together with use_prefix_grouper); one mini-batch: "
                                "nothing to shuffle.")
    grad_clip: float = spec(1.0, "Max global gradient norm.")
    tis_imp_ratio_cap: float = spec(-1.0, "Truncated IS cap on old/rollout ratio; -1 disables.")
    use_token_level_loss: bool | None = spec(None, "Old verl DAPO key; loss_agg_mode=token-mean replaces it.")
    ulysses_sequence_parallel_size: int = spec(
        1, "Ulysses sequence parallelism (verl's key): groups of this many devices compute each micro-batch "
           "together, each running every layer on 1/size of the packed tokens, with all-to-alls around attention "
           "(lathe.train.ulysses); it must divide the devices and the model's heads, needs model.use_remove_padding, "
           "and the token budgets (ppo_max_token_len_per_gpu, the rollout's log_prob_max_token_len_per_gpu) count "
           "per device, so a micro-batch holds budget x size tokens. 1: off.")
    entropy_from_logits_with_chunking: bool = spec(False, "Chunk the entropy computation (verl).")
    entropy_checkpointing: bool = spec(False, "Recompute entropy in backward (verl).")
    use_torch_compile: bool = spec(True, "torch.compile lathe's decoder layers and chunked log-prob/entropy math "
                                         "on CUDA (CPU runs eager); false, or fsdp_config.use_torch_compile=false, "
                                         "runs eager.")
    use_fused_kernels: bool = spec(False, "Fused log-prob kernels (verl).")
    use_remove_padding: bool = spec(True, "verl's actor switch for the packed forward (verl's default: on); lathe "
                                          "packs actor and reference by model.use_remove_padding.")
    freeze_vision_tower: bool = spec(False, "Freeze a VLM's vision tower (verl).")
    data_loader_seed: int | None = spec(None, "Seed of the shuffle's orders (with the update count and the epoch); "
                                              "null = trainer.seed.")
    checkpoint: CheckpointConfig = spec(factory=CheckpointConfig, help="Checkpoint contents.")
    optim: OptimConfig = spec(factory=OptimConfig, help="Actor optimizer.")
    fsdp_config: ActorFSDPConfig = spec(factory=ActorFSDPConfig, help="Actor sharding/offload (and FP8 training).")
    profiler: dict[str, Any] = spec({}, "verl profiler settings.")


@dataclass
class RefConfig:
    """Frozen reference policy for the KL term (verl ``actor_rollout_ref.ref``)."""

    strategy: Strategy = spec("fsdp", "Training backend (verl: fsdp|fsdp2|megatron).")
    log_prob_micro_batch_size: int | None = spec(None, "Deprecated (verl) global micro-batch; converted.")
    log_prob_micro_batch_size_per_gpu: int | None = spec(
        None, "Sequences per device per ref log-prob forward; null = lathe picks.")
    log_prob_use_dynamic_bsz: bool | None = spec(None, "Token-count micro-batches; null = actor.use_dynamic_bsz.")
    log_prob_max_token_len_per_gpu: int | None = spec(
        None, "Token budget per micro-batch; null = actor.ppo_max_token_len_per_gpu.")
    ulysses_sequence_parallel_size: int | None = spec(
        None, "Ulysses sequence parallelism of the reference's log-prob pass (as actor.ulysses_sequence_parallel_size; "
              "its budget is log_prob_max_token_len_per_gpu x size); null = the actor's (verl).")
    use_torch_compile: bool | None = spec(None, "null = actor.use_torch_compile.")
    entropy_from_logits_with_chunking: bool = spec(False, "Chunk the entropy computation (verl).")
    entropy_checkpointing: bool = spec(False, "Recompute entropy in backward (verl).")
    fsdp_config: FSDPConfig = spec(factory=FSDPConfig, help="Ref sharding/offload (param_offload useful).")
    quantization: str | None = spec(None, "lathe: fp8: the reference's decoder-layer projections in FP8, as "
                                          "rollout.quantization=fp8 runs the engine's (per-channel weights quantised "
                                          "once, per-token activations; lathe.engine.fp8): its log-probs then carry "
                                          "FP8 rounding, so the KL starts above 0. One device, lathe's decoder, no "
                                          "LoRA. null: the reference's dtype.")
    profiler: dict[str, Any] = spec({}, "verl profiler settings.")
