"""The closed sets of values that choice keys take, as ``Literal`` types for the schema.

A key whose value must be one of a fixed set is typed with one of these, so ``coerce`` rejects anything else when
the value is set, naming the key, the value and the choices. Sets a user can extend stay ``str`` in the schema and
are checked by their registry (advantage estimators and policy losses: ``lathe.algo.registry``; reward managers,
optimizer classes, tool classes, model paths).

Several sets mirror a table in a package ``config/`` may not import (it is a leaf: no torch); each such Literal
names its table, and ``tests/config/test_choices.py`` checks that they agree.
"""

from __future__ import annotations

from typing import Literal

# lathe.dtypes.DTYPES: verl's spellings of the training dtypes (fsdp_config.model_dtype, mixed_precision.*)
DtypeName = Literal["fp32", "float32", "32", "bf16", "bfloat16", "fp16", "float16", "16"]
# lathe.dtypes.rollout_dtype: the engine's weights and KV-cache dtype on CUDA (float32 on CPU)
RolloutDtype = Literal["bfloat16", "float16", "float32"]
# lathe.engine.kv_cache.KV_CACHE_DTYPES: the engine's KV-cache storage (vLLM's names; auto = the rollout dtype)
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
# lathe.config.data_parallel_attention: verl's EP = D x TP as data-parallel attention or as replicas of whole experts
DataParallelAttention = Literal["auto", "always", "never"]
# verl's training backends; lathe trains every one of them with its FSDP2 trainer (support.py says so once)
Strategy = Literal["fsdp", "fsdp2", "fsdp_turbo", "megatron", "megatron_lite", "veomni", "torchtitan"]
# verl's `model_engine` (the Hydra group that picks the backend's config groups); dp = fsdp
ModelEngine = Literal["dp", "fsdp", "megatron", "veomni", "torchtitan"]
# lathe.train.fp8.RECIPES: torchao float8 training recipes of the actor's linear layers (null = bf16)
Fp8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# verl's fsdp_config.strategy (an engine override within FSDP)
FSDPStrategy = Literal["fsdp", "fsdp2"]
# the learning-rate schedule after warmup: verl's FSDP schedules, then Megatron's (lathe.train.optim.schedule_rate)
ScheduleName = Literal["constant", "cosine", "linear", "inverse_square_root", "WSD"]
# Megatron's lr_decay_style: the same, and its own spelling of the inverse square root
MegatronSchedule = Literal["constant", "cosine", "linear", "inverse_square_root", "inverse-square-root", "WSD"]
# the annealing of Megatron's WSD schedule (lr_wsd_decay_style)
WSDDecay = Literal["linear", "cosine", "exponential", "minus_sqrt"]
# lathe.algo.aggregate.LOSS_AGG_MODES
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# lathe.algo.kl.KL_PENALTIES: k1/k2/k3 estimators by either name; a trailing + takes k2's gradient (straight-through)
KLEstimator = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                      "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
# lathe.algo.kl.make_kl_controller
KLControllerType = Literal["fixed", "adaptive"]
# lathe.algo.rollout_correction.compute_rollout_correction_weights (null = off)
ISLevel = Literal["token", "sequence"]
# lathe.algo.bypass: the loss of bypass mode
BypassLoss = Literal["ppo_clip", "reinforce"]
# lathe.algo.pf_ppo.REWEIGHT_METHODS: verl's PF-PPO reweighting methods
ReweightMethod = Literal["pow", "max_min", "max_random"]
# lathe.rollout.agent.parser.PARSERS
ToolCallFormat = Literal["hermes", "llama3_json"]
# lathe.rollout.agent: which part of a long tool answer stays
TruncateSide = Literal["left", "right", "middle"]
# verl's multi-turn tokenization check
SanityCheckMode = Literal["strict", "ignore_strippable", "disable"]
# verl's rollout modes
RolloutMode = Literal["sync", "async"]
# verl's (vLLM's) rollout log-prob modes; support_rollout.py refuses all but lathe's, processed_logprobs
LogprobsMode = Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"]
# verl's (vLLM's) engine scheduling policies; lathe's engine is first come, first served
SchedulingPolicy = Literal["fcfs", "priority"]
# verl's worker implementation switch
LegacyWorkerImpl = Literal["auto", "enable", "disable"]
# verl's global_profiler tools; rules.py refuses all but torch with what each is
ProfilerTool = Literal["torch", "nsys", "npu", "torch_memory"]
# verl's checkpoint contents
CheckpointPart = Literal["model", "optimizer", "extra", "hf_model"]
