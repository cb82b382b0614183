"""Config groups for generation (verl ``actor_rollout_ref.rollout``) and the group that holds them.

lathe ships two rollout backends: ``lathe`` (the built-in paged engine) and ``hf`` (transformers
``generate``); ``auto`` (the default) picks the engine when lathe's decoder runs the actor's architecture.
verl's inference backends (``vllm``, ``sglang``, ``trtllm``) run as ``auto`` does, with one notice at start-up;
their engine keys act on lathe's engine (``backends.py`` maps ``engine_kwargs``, ``support_rollout.py`` lists the
keys with no effect or refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .choices import (DataParallelAttention, KVCacheDtype, LogprobsMode, RolloutDtype, RolloutMode, SanityCheckMode,
                      SchedulingPolicy, ToolCallFormat, TruncateSide)
from .coerce import spec
from .schema_async import CheckpointEngineConfig
from .schema_actor import ActorConfig, ModelConfig, RefConfig


@dataclass
class ValKwargsConfig:
    """Sampling used for validation (verl ``rollout.val_kwargs``); greedy by default."""

    n: int = spec(1, "Responses per validation prompt.")
    temperature: float = spec(0.0, "Sampling temperature; 0 = greedy.")
    top_p: float = spec(1.0, "Nucleus sampling mass, in (0, 1].")
    top_k: int = spec(-1, "Top-k; -1 disables.")
    do_sample: bool = spec(False, "Sample (true) or decode greedily (false).")


@dataclass
class MultiTurnConfig:
    """Multi-turn / tool-calling rollouts (verl ``rollout.multi_turn``)."""

    enable: bool = spec(False, "Run agent loops with tools instead of single-turn generation.")
    max_assistant_turns: int | None = spec(None, "Cap on assistant turns; null = no cap.")
    max_user_turns: int | None = spec(None, "Cap on user/tool turns; null = no cap.")
    tool_config_path: str | None = spec(None, "YAML file describing the tools.")
    interaction_config_path: str | None = spec(None, "YAML file describing simulated users.")
    max_parallel_calls: int = spec(1, "Tool calls run per model turn (at once); later calls of a turn are dropped.")
    max_tool_response_length: int = spec(256, "A tool answer is cut to this many characters (verl).")
    tool_response_truncate_side: TruncateSide = spec("middle", "Which part of a long tool answer stays: left (the start), "
                                                      "right (the end) or middle (both ends).")
    tool_timeout: float = spec(30.0, "lathe: seconds a tool call may take; then the model reads a timeout error.")
    max_concurrent_tool_calls: int = spec(32, "lathe: tool calls running at once across all trajectories.")
    use_inference_chat_template: bool = spec(False, "verl: apply the chat template used at inference (no effect: "
                                                    "lathe never re-renders a conversation).")
    tokenization_sanity_check_mode: SanityCheckMode = spec("strict", "verl: strict | ignore_strippable | disable (no effect: "
                                                         "lathe never re-tokenises a conversation).")
    format: ToolCallFormat = spec("hermes", "Tool-call format of the model's text: hermes (<tool_call>{json}</tool_call>, "
                                 "Qwen2.5/Qwen3) or llama3_json (Llama 3.1+).")
    function_tool_path: str | None = spec(None, "verl: a Python file of @function_tool functions (from "
                                                "lathe.rollout.agent.function_tools), tools beside tool_config_path's.")
    num_repeat_rollouts: int | None = spec(None, "verl: repeat rollouts per sample (no effect: rollout.n sets them).")


@dataclass
class PrometheusConfig:
    """verl's ``rollout.prometheus``: a Prometheus endpoint of vLLM/SGLang servers (no effect in lathe)."""

    enable: bool = spec(False, "Serve the engine's metrics to Prometheus (no effect: lathe logs them with the "
                               "step's metrics).")
    port: int = spec(9090, "Prometheus port (read only with enable).")
    file: str = spec("/tmp/ray/session_latest/metrics/prometheus/prometheus.yml", "Prometheus config file (read "
                                                                                  "only with enable).")
    served_model_name: str | None = spec(None, "Model name shown in Grafana (read only with enable).")


@dataclass
class ServerConfig:
    """verl's ``rollout.server``: the HTTP client of SGLang's server mode (no effect: lathe's engine is in-process)."""

    timeout: float = spec(60.0, "Seconds a request may take.")
    max_attempts: int = spec(3, "Tries per request.")
    retry_delay: float = spec(2.0, "Seconds between tries.")
    max_connections: int = spec(1000, "Open connections at most.")
    max_start_wait_time: float = spec(300.0, "Seconds the server may take to start.")


@dataclass
class DisaggregationConfig:
    """verl's ``rollout.disaggregation``: prefill and decode on separate engine replicas (not implemented)."""

    enabled: bool = spec(False, "Prefill-decode disaggregation (not implemented in lathe).")
    prefill_replicas: int = spec(1, "Prefill replicas (read only with enabled).")
    decode_replicas: int = spec(1, "Decode replicas (read only with enabled).")
    decode_tensor_model_parallel_size: int | None = spec(None, "Decode replicas' TP size (read only with enabled).")
    transfer_backend: str = spec("nixl", "KV transfer backend (read only with enabled).")
    bootstrap_port: int | None = spec(None, "Prefill bootstrap port (read only with enabled).")
    ib_device: str | None = spec(None, "InfiniBand device (read only with enabled).")


@dataclass
class RolloutConfig:
    """Response generation for training and validation."""

    name: Literal["auto", "lathe", "hf", "vllm", "sglang", "trtllm"] = spec(
        "auto", "Backend: lathe (built-in paged engine, needs lathe's decoder: Llama/Qwen2/Qwen3), hf "
                "(transformers generate, any causal LM), or auto (lathe when the actor runs lathe's decoder, "
                "else hf). vllm/sglang/trtllm (verl's backends) run as auto does, with a notice: lathe runs "
                "its own engine, and their engine keys act on it.")
    mode: RolloutMode = spec("sync", "verl: sync | async (server-based) generation.")
    nnodes: int = spec(0, "verl: nodes of a standalone rollout server; 0 = colocated (lathe's rollout pool is the "
                          "top-level rollout.nnodes).")
    n_gpus_per_node: int | None = spec(None, "verl: devices per node of a standalone rollout server; null = "
                                             "trainer.n_gpus_per_node (lathe's pool: rollout.n_gpus_per_node).")
    full_determinism: bool = spec(False, "verl: batch-invariant, bitwise-reproducible rollouts.")
    seed: int = spec(42, "verl: the inference engine's sampling seed (lathe seeds rollouts from trainer.seed).")
    repetition_penalty: float = spec(1.0, "verl: penalty on tokens already generated (not implemented; 1 = off).")
    n: int = spec(1, "Responses sampled per prompt (GRPO group size).")
    temperature: float = spec(1.0, "Sampling temperature (> 0).")
    top_p: float = spec(1.0, "Nucleus sampling mass, in (0, 1].")
    top_k: int = spec(-1, "Top-k; -1 disables.")
    do_sample: bool = spec(True, "Sample (true) or decode greedily (false).")
    ignore_eos: bool = spec(False, "Keep generating past EOS up to response_length.")
    prompt_length: int | None = spec(None, "Prompt token budget; null = data.max_prompt_length.")
    response_length: int | None = spec(None, "Response token budget; null = data.max_response_length.")
    dtype: RolloutDtype = spec("bfloat16", "Engine weights and KV-cache dtype (bfloat16|float16|float32) on CUDA; "
                                  "CPU runs use float32. The hf backend shares the actor's dtype.")
    gpu_memory_utilization: float = spec(0.5, "Fraction of device memory the engine may use (weights + KV cache).")
    standalone_gpu_memory_utilization: float | None = spec(
        None, "The same for the engines of a rollout pool of its own (fully-async training); null = "
              "gpu_memory_utilization.")
    tensor_model_parallel_size: int = spec(
        1, "Devices per engine replica (tensor parallelism: each holds 1/size of every layer's heads and MLP "
           "columns and of the vocabulary; the trainer's devices form trainer devices / size replicas, each "
           "generating its share of the prompts). A divisor of trainer.n_gpus_per_node, or whole nodes. verl's "
           "default is 2, lathe's 1 (a whole model per device is fastest while it fits).")
    data_parallel_size: int = spec(
        1, "Data-parallel degree of the engine (verl; vLLM/SGLang's data-parallel attention): D replicas of "
           "tensor_model_parallel_size ranks form one engine, each replica generating its own prompts. With "
           "expert_parallel_size = D x tensor_model_parallel_size a mixture-of-experts model's routed experts are "
           "spread over all D x TP ranks and the replicas step in lockstep (the agent loop, fully-async "
           "training and speculative decoding run it as replicas of whole experts, with a notice); with "
           "expert_parallel_size = TP or 1 the D replicas hold whole experts (faster while they fit).")
    data_parallel_attention: DataParallelAttention = spec(
        "auto", "lathe: how data_parallel_size D with expert_parallel_size D x TP runs. always: data-parallel "
                "attention (the experts over all D x TP ranks); never: D replicas of whole experts (the same "
                "samples); auto: replicas of whole experts on GPUs where the memory plan leaves them a KV cache for "
                "all the sequences data-parallel attention would run at once (they generate 1.2x "
                "faster: docs/distributed.md), else data-parallel attention (a notice says which); CPU runs: "
                "data-parallel attention.")
    expert_parallel_size: int = spec(
        1, "Expert-parallel degree of the engine (verl; vLLM's enable_expert_parallel when above 1). lathe: a "
           "mixture-of-experts model (Qwen3-MoE, GPT-OSS, Qwen3.5-MoE, Qwen3-Next, DeepSeek-V3) in replicas of "
           "tensor_model_parallel_size > 1 needs it equal to that size (each rank then holds num_experts / size "
           "whole experts), or to data_parallel_size x that size (data-parallel attention: num_experts / (D x TP) "
           "each); 1 for a dense model or one device a replica.")
    pipeline_model_parallel_size: int = spec(1, "Pipeline-parallel degree of the engine (verl).")
    moe_tensor_parallel_size: int = spec(1, "Tensor-parallel degree of MoE layers (verl, TensorRT-LLM).")
    max_num_batched_tokens: int = spec(
        16384, "Token budget of one engine step (prefill chunking). lathe's default is 16384 (verl's yaml says "
               "8192): half as many prefill steps, whose host cost bounds a small model's prefill; a step's "
               "activations grow with it (~1 GB more at 7B than at 8192), so lower it where memory is tight.")
    max_model_len: int | None = spec(None, "Max prompt+response length; null = prompt_length + response_length.")
    max_num_seqs: int = spec(1024, "Max sequences running at once in the engine.")
    enforce_eager: bool = spec(False, "Disable CUDA graphs in the engine.")
    cudagraph_capture_sizes: list[int] | None = spec(None, "Decode batch sizes to capture as CUDA graphs (a step is "
                                                           "padded to the next one; larger steps run eagerly); "
                                                           "null = lathe's buckets up to max_num_seqs.")
    free_cache_engine: bool = spec(True, "Release the engine's KV cache while training (CUDA; kept on CPU).")
    enable_chunked_prefill: bool = spec(True, "Split long prefills across engine steps.")
    enable_prefix_caching: bool = spec(True, "Share KV blocks of identical prompt prefixes (off: a prompt's n "
                                             "samples still share its prefill).")
    load_format: str = spec("dummy", "How the engine first gets weights (verl).")
    logprobs_mode: LogprobsMode = spec(
        "processed_logprobs", "What the engine returns per token (verl/vLLM); lathe returns processed_logprobs: "
                              "log_softmax(logits / temperature) of the sampled token over the whole vocabulary.")
    scheduling_policy: SchedulingPolicy = spec("fcfs", "Engine request order (verl/vLLM); lathe's engine runs first "
                                                       "come, first served.")
    layered_summon: bool = spec(False, "Gather sharded weights layer by layer for the engine (verl).")
    log_prob_micro_batch_size: int | None = spec(None, "Deprecated (verl) global micro-batch; converted.")
    log_prob_micro_batch_size_per_gpu: int | None = spec(
        None, "Sequences per device per old-log-prob forward; null = lathe picks.")
    log_prob_use_dynamic_bsz: bool | None = spec(None, "null = actor.use_dynamic_bsz.")
    log_prob_max_token_len_per_gpu: int | None = spec(None, "null = actor.ppo_max_token_len_per_gpu.")
    disable_log_stats: bool = spec(True, "Silence the engine's own stats logging.")
    calculate_log_probs: bool = spec(False, "Return the engine's log-probs (rollout_correction uses them).")
    over_sample_rate: float = spec(0.0, "Sample extra prompts and abort the slowest rollouts (verl).")
    multi_stage_wake_up: bool = spec(False, "Wake the engine up in stages to save memory (verl).")
    update_weights_bucket_megabytes: int = spec(512, "Bucket size (MB) of the weight sync to a separate rollout pool.")
    checkpoint_engine: CheckpointEngineConfig = spec(factory=CheckpointEngineConfig, help="How weights reach the "
                                                                                           "rollout.")
    skip_rollout: bool = spec(False, "Replay dumped rollouts instead of generating (verl debug).")
    skip_dump_dir: str = spec("/tmp/rollout_dump", "Where skip_rollout's dumps live (verl).")
    skip_tokenizer_init: bool = spec(True, "Engine without its own tokenizer (verl).")
    use_fire_sampling: bool = spec(False, "Old verl key.")
    chat_scheduler: str | None = spec(None, "Old verl key.")
    engine_kwargs: dict[str, Any] = spec({"vllm": {}, "sglang": {}, "trtllm": {}}, "verl's engine arguments per "
                                         "backend; those of rollout.name's backend with a lathe meaning act "
                                         "(config/backends.py), the others warn.")
    val_kwargs: ValKwargsConfig = spec(factory=ValKwargsConfig, help="Validation sampling.")
    multi_turn: MultiTurnConfig = spec(factory=MultiTurnConfig, help="Multi-turn / tool rollouts.")
    agent: dict[str, Any] = spec({}, "verl agent-loop settings.")
    trace: dict[str, Any] = spec({}, "verl rollout tracing.")
    profiler: dict[str, Any] = spec({}, "verl profiler settings.")
    prometheus: PrometheusConfig = spec(factory=PrometheusConfig, help="verl: the engine servers' Prometheus "
                                                                       "endpoint.")
    enable_rollout_routing_replay: bool = spec(False, "verl: record MoE routing in the rollout to replay it in "
                                                      "training.")
    moe_load_balance_metrics_interval: int = spec(0, "verl: steps between MoE load-balance metrics from routing "
                                                     "replay; 0 = off.")
    quantization: str | None = spec(None, "verl: quantized rollout weights. fp8: the decoder layers' projections in "
                                          "FP8 (per-channel weights, per-token activations; lathe.engine.fp8), "
                                          "re-quantised at each weight sync; null: the rollout dtype.")
    quantize_lm_head: bool = spec(False, "lathe: with quantization=fp8, the lm_head in FP8 too (per vocabulary "
                                         "row and per token): the sampler's logits then come from an FP8 "
                                         "product (at 7B ~2% faster decoding than FP8 projections alone, the "
                                         "rollout/trainer log-prob gap, training/rollout_probs_diff_*, about the "
                                         "same: README). false: bf16, as vLLM keeps it.")
    shared_prefix_attention: bool = spec(True, "lathe: in decode steps (CUDA graphs, Triton attention), the rows "
                                               "sharing a prompt of 768 tokens or more (512 for models with 512+ "
                                               "K/V values a token and layer; the n samples of a prompt) attend "
                                               "over it once per group of rows, each K/V tile read once for the "
                                               "group (on an H200 1.14-1.41x faster decode attention at 1024- and "
                                               "2048-token prompts: README). false: every row reads its whole "
                                               "context.")
    kv_cache_dtype: KVCacheDtype = spec("auto", "lathe (engine_kwargs.vllm/sglang.kv_cache_dtype set it): the "
                                                "engine's paged KV cache. auto: the rollout dtype; fp8 (= "
                                                "fp8_e4m3): float8_e4m3fn K/V with a float32 scale per token and "
                                                "KV head (max|x|/448, set when the token is stored), ~1.9x the "
                                                "tokens in the same memory, attention in the rollout dtype after "
                                                "dequantising (lathe.engine.kv_cache).")
    quantization_correction: bool = spec(True, "lathe: with quantization set (or kv_cache_dtype=fp8, or the "
                                               "actor's fsdp_config.fp8_training) and no algorithm."
                                               "rollout_correction configured, correct the log-prob gap between the rollout and the trainer (their "
                                               "precisions differ) by token-level truncated IS (rollout_is=token, "
                                               "threshold 2; not in fully-async mode when the rollout's log-probs "
                                               "are PPO's old ones); false: leave it off.")
    quantization_config_file: str | None = spec(None, "verl: the quantization's settings file.")
    mtp: dict[str, Any] | None = spec(None, "verl: multi-token-prediction settings (enable_rollout: speculative "
                                            "decoding with the MTP heads).")
    qat: dict[str, Any] | None = spec(None, "verl: quantization-aware training's quantized rollout.")
    disaggregation: DisaggregationConfig = spec(factory=DisaggregationConfig, help="verl: prefill-decode "
                                                                                   "disaggregation.")
    # verl's RolloutConfig fields that its YAML leaves out (set with +key=...)
    enable_sleep_mode: bool = spec(True, "verl: let the engine release its memory between rollouts (lathe: "
                                         "free_cache_engine).")
    limit_images: int | None = spec(None, "verl: images per prompt the engine accepts; null = no limit.")
    server: ServerConfig = spec(factory=ServerConfig, help="verl: SGLang server-mode client settings.")
    custom: dict[str, Any] | None = spec(None, "verl: free-form settings of custom rollout code.")
    checkpoint_manager_class: str | None = spec(None, "verl: a checkpoint-engine manager class of its own.")
    layer_name_map: dict[str, Any] = spec({}, "verl: weight-name map from the trainer's to the engine's names.")
    sglang_engine_mode: str = spec("local", "verl: how SGLang's engine is started.")


@dataclass
class ActorRolloutRefConfig:
    """verl's ``actor_rollout_ref``: the policy model and its three roles."""

    hybrid_engine: bool = spec(True, "Actor and rollout share devices and weights (colocated).")
    nccl_timeout: int = spec(600, "Seconds before a collective is declared hung.")
    model: ModelConfig = spec(factory=ModelConfig, help="The policy model.")
    actor: ActorConfig = spec(factory=ActorConfig, help="Policy update.")
    ref: RefConfig = spec(factory=RefConfig, help="Reference policy.")
    rollout: RolloutConfig = spec(factory=RolloutConfig, help="Generation.")
