"""The support registry's entries for ``actor_rollout_ref.rollout``: verl's inference-backend keys on lathe's engine.

verl's rollout keys describe vLLM/SGLang/TensorRT-LLM servers. lathe runs its own engine in their place
(``rollout.name=vllm|sglang|trtllm`` runs it with a notice, see ``lathe.rollout.build``); the engine keys with a
lathe meaning act (gpu_memory_utilization, enforce_eager, max_num_batched_tokens, ...), ``engine_kwargs`` is
judged entry by entry (``backends.py``), and the keys below have no effect or ask for a feature lathe lacks, named
with the issue that brings it. ``support.py`` includes ``ROLLOUT_FEATURES`` in its registry.
"""

from __future__ import annotations

from dataclasses import replace

from .backends import QUANTIZED, engine_kwargs_verdict
from .coerce import show
from .plan import is_async
from .support_base import Entry, at_most, no_entries, only_on, refuse, same_as, warn

R = "actor_rollout_ref.rollout"
MODEL_PARALLEL = "lathe issue 43: model-parallel engine replicas; lathe's are tensor-parallel and data-parallel " \
                 "over the trainer's devices"
ROUTING = "MoE routing replay (R2/R3, lathe issue 44)"
POOL = ("set the top-level rollout.nnodes and rollout.n_gpus_per_node (lathe's rollout pool: fully asynchronous "
        "training), and remove {key}")


def _agent(value, cfg) -> tuple[str, str] | None:
    """verl's agent loop settings without custom loops (with them, `agent_loop_config_path` set, `rules_agent` judges
    the group): its worker count has no effect; `default_agent_loop` single_turn_agent is lathe's single-turn
    rollout and tool_agent its tool loop (`rules_agent.apply_tool_agent`); a custom loop no file lists, a custom
    manager or server is refused."""
    value = value or {}
    loop = value.get("default_agent_loop", "single_turn_agent")
    refused = unsupported_agent_keys(value)
    if refused:
        return "refuse", refused
    if loop not in ("single_turn_agent", "tool_agent"):
        return "refuse", (f"`{R}.agent.default_agent_loop`={loop!r} names a custom agent loop, but no "
                          f"{R}.agent.agent_loop_config_path lists it. Fix: set agent_loop_config_path to the YAML "
                          f"file of your loops (- name: {loop} / _target_: your_pkg.module.YourAgentLoop).")
    if value.get("num_workers") in (None, VERL_AGENT_WORKERS):       # (quiet at verl's default)
        return None         # (tool_agent: lathe's tool loop, multi_turn.enable turned on: rules_agent.apply_tool_agent)
    return "warn", (f"`{R}.agent.num_workers`={show(value['num_workers'])} has no effect in lathe: lathe's engine "
                    f"needs no agent-loop workers.")


VERL_AGENT_WORKERS = 8     # verl's rollout.agent.num_workers default


def unsupported_agent_keys(value: dict) -> str | None:
    """The refusal of `rollout.agent` keys lathe does not implement (a custom async server...), or None."""
    custom = {k: v for k, v in value.items() if k not in ("num_workers", "default_agent_loop",
                                                          "agent_loop_config_path")
              and v not in (None, {}, {"path": None, "name": None})}
    if not custom:
        return None
    return (f"`{R}.agent`: {show(custom)} is not implemented yet in lathe (lathe's engine serves the agent loops "
            f"itself). Fix: remove it.")


def _pool_keys() -> list[Entry]:
    """verl's standalone rollout server sizes; lathe's rollout pool is the top-level `rollout` group (verl's
    fully-async recipe copies rollout.nnodes here, so equal values are accepted)."""
    return [refuse(f"{R}.nnodes", "a standalone rollout server set under actor_rollout_ref.rollout", POOL,
                   lambda v, cfg: v == 0 or is_async(cfg) and v == cfg.rollout.nnodes),
            refuse(f"{R}.n_gpus_per_node", "a standalone rollout server set under actor_rollout_ref.rollout", POOL,
                   lambda v, cfg: v in (None, cfg.trainer.n_gpus_per_node)
                   or is_async(cfg) and v == cfg.rollout.n_gpus_per_node)]


def _backends() -> list[Entry]:
    out = [replace(warn(f"{R}.engine_kwargs", "verl's engine arguments: those of rollout.name's backend with a "
                         "lathe meaning act (vLLM's max_num_seqs, gpu_memory_utilization, compilation_config."
                         "cudagraph_capture_sizes...; SGLang's mem_fraction_static, chunked_prefill_size...; "
                         "TensorRT-LLM's max_batch_size, max_num_tokens...; vLLM's and SGLang's kv_cache_dtype=fp8 "
                         "or fp8_e4m3: lathe's FP8 KV cache, rollout.kv_cache_dtype), a KV cache of another dtype "
                         "(fp8_e5m2...) and speculative decoding are refused, the rest have no effect", no_entries),
                   judge=engine_kwargs_verdict),
            refuse(f"{R}.logprobs_mode", "returning raw log-probs or logits from the rollout",
                   "remove it: lathe's engine returns processed_logprobs, log_softmax(logits / temperature) of the "
                   "sampled token over the whole vocabulary",
                   lambda v, cfg: v == "processed_logprobs" or v == "raw_logprobs" and cfg.actor_rollout_ref.rollout.
                   temperature == 1),
            warn(f"{R}.scheduling_policy", "lathe's engine admits requests first come, first served, and lathe's "
                 "rollouts give them no priorities"),
            warn(f"{R}.full_determinism", "lathe's engine seeds every sample by its index, so it does not depend on "
                 "its batch; logits bitwise equal across batch shapes on a GPU (batch-invariant kernels) are not "
                 "implemented"),
            warn(f"{R}.seed", "lathe seeds each rollout from trainer.seed, the step and the sample's index",
                 lambda v, cfg: v in (42, cfg.trainer.seed)),
            *_pool_keys(),
            warn(f"{R}.prometheus.enable", "lathe's engine serves no Prometheus endpoint; its metrics are logged "
                 "with each step's (trainer.logger)")]
    out += [only_on("synchronous training", warn(f"{R}.standalone_gpu_memory_utilization", (
                "it sizes the engines of a rollout pool of its own (fully-async training); colocated, "
                "gpu_memory_utilization does"))),
            warn(f"{R}.enable_sleep_mode", "lathe's engine releases its KV cache between rollouts by "
                 "free_cache_engine (set free_cache_engine=false to keep it)"),
            warn(f"{R}.limit_images", "lathe's engine takes every image of a prompt"),
            warn(f"{R}.sglang_engine_mode", "lathe's engine runs in the trainer's processes"),
            warn(f"{R}.layer_name_map", "lathe's engine loads the trainer's weights by their Hugging Face names",
                 no_entries),
            warn(f"{R}.custom", "it is read only by custom rollout code", lambda v, cfg: not v),
            refuse(f"{R}.checkpoint_manager_class", "a checkpoint-engine manager of its own")]
    out += [warn(f"{R}.server.{k}", "SGLang server-mode settings; lathe's engine runs in-process")
            for k in ("timeout", "max_attempts", "retry_delay", "max_connections", "max_start_wait_time")]
    unread = "it is read only with prometheus.enable=true, which has no effect"
    out += [warn(f"{R}.prometheus.{k}", unread) for k in ("port", "file")]
    out.append(warn(f"{R}.prometheus.served_model_name", unread, same_as("actor_rollout_ref.model.path")))
    return out


def _moe_tensor_parallel(value, cfg) -> tuple[str, str] | None:
    """verl's (TensorRT-LLM's) rollout.moe_tensor_parallel_size M with expert_parallel_size EP, M x EP = TP: each
    expert cut over M ranks and the experts over EP groups of them; lathe places whole experts over the replica's TP
    ranks instead (`engine_data_parallel` sets EP = TP): the same computation, another layout."""
    if value in (None, 1):
        return None
    ro, key = cfg.actor_rollout_ref.rollout, f"{R}.moe_tensor_parallel_size"
    tp, ep = ro.tensor_model_parallel_size, ro.expert_parallel_size
    if value * ep != tp:
        return "refuse", (f"`{key}`={show(value)} with expert_parallel_size={ep}: tensor-parallel MoE layers "
                          f"({MODEL_PARALLEL}) are not lathe's; it places whole experts over a replica's "
                          f"tensor_model_parallel_size={tp} ranks, which stands in for moe_tensor_parallel_size x "
                          f"expert_parallel_size = tensor_model_parallel_size only. Fix: set it to 1 (or to "
                          f"{tp} / expert_parallel_size).")
    return "warn", (f"`{key}`={value} x expert_parallel_size={ep}: lathe places whole experts over each replica's "
                    f"{tp} ranks instead of cutting each expert over {value} of them (the same computation, another "
                    "layout).")


def _lacking() -> list[Entry]:
    """Features of verl's engines that lathe does not have yet: refused, with the issue that brings them."""
    out = [refuse(f"{R}.pipeline_model_parallel_size", f"pipeline-parallel generation ({MODEL_PARALLEL})",
                   "set it to 1", at_most(1))]
    out += [replace(refuse(f"{R}.moe_tensor_parallel_size", f"tensor-parallel MoE layers ({MODEL_PARALLEL})"),
                    judge=_moe_tensor_parallel)]
    out += [refuse(f"{R}.repetition_penalty", "a repetition penalty in sampling", ok=lambda v, cfg: v == 1),
            warn(f"{R}.quantization_config_file", f"it is read only with {R}.quantization ({QUANTIZED})"),
            refuse(f"{R}.qat", f"quantization-aware training's {QUANTIZED}",    # verl copies the actor's qat here
                   ok=lambda v, cfg: not v or not v.get("enable")),
            *[refuse(f"actor_rollout_ref.actor.router_replay.{k}", "routing replay through files (verl's Megatron)",
                     "remove it; router_replay.mode replays within each step") for k in ("record_file", "replay_file")],
            warn(f"{R}.moe_load_balance_metrics_interval", f"lathe does not report the rollout's MoE load-balance "
                 f"metrics yet ({ROUTING})"),
            warn(f"{R}.mtp", "lathe's engine reads actor_rollout_ref.model.mtp (verl copies it here); set "
                 "model.mtp.enable=true and model.mtp.enable_rollout=true for speculative decoding",
                 lambda v, cfg: not v or not v.get("enable_rollout") or cfg.actor_rollout_ref.model.mtp.enable_rollout),
            refuse(f"{R}.disaggregation.enabled", "prefill-decode disaggregation (prefill and decode on separate "
                   "engine replicas)")]
    out += [warn(f"{R}.disaggregation.{k}", "it is read only with disaggregation.enabled=true (not implemented)")
            for k in ("prefill_replicas", "decode_replicas", "decode_tensor_model_parallel_size",
                      "transfer_backend", "bootstrap_port", "ib_device")]
    out += [warn(f"{R}.multi_turn.num_repeat_rollouts", f"responses per prompt are {R}.n"),
            only_on("no custom agent loops", replace(refuse(
                f"{R}.agent", "a custom async server (agent.custom_async_server) or agent-loop manager (custom agent "
                "loops act: agent_loop_config_path, default_agent_loop, a row's agent_name; agent.num_workers has no "
                "effect)", "remove it"), judge=_agent)),
            warn(f"{R}.checkpoint_engine.engine_kwargs", "they are arguments of verl's checkpoint-engine backends; "
                 "lathe's weight sync takes none", no_entries),
            refuse(f"{R}.checkpoint_engine.custom_backend_module", "a checkpoint-engine backend of its own",
                   f"remove it; {R}.checkpoint_engine.backend picks lathe's (auto, naive or nccl)")]
    return out


ROLLOUT_FEATURES = {
    "Rollout: verl's inference-backend keys (vLLM / SGLang / TensorRT-LLM)": _backends,
    "Rollout: engine features lathe lacks": _lacking,
}
