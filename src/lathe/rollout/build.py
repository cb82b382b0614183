"""Building a rollout backend from `actor_rollout_ref.rollout`: lathe's engine or transformers' `generate`.

`rollout.name` (`auto` by default) picks the backend for the policy the actor runs:

- `lathe`: lathe's paged engine (`lathe.engine.llm_engine.LatheEngine`) over lathe's decoder (or a VL model), in
  `rollout.dtype` (float32 on CPU). `auto` picks it whenever the actor runs lathe's decoder.
- `hf`: transformers `generate` on a transformers module (the actor's own, or a copy of it).
- `vllm`, `sglang`, `trtllm` (verl's backends, set by every verl launch script): as `auto`, with one notice in the
  start-up's 'rollout:' line that lathe's engine runs in their place (their engine keys act on it).
"""

from __future__ import annotations

import logging

import torch

from lathe.dtypes import rollout_dtype
from lathe.engine.llm_engine import LatheEngine
from lathe.models.rope import cast_keeping_rope
from lathe.models.vl import is_vl
from lathe.models.config import SUPPORTED_ARCHITECTURES
from lathe.models.decoder import LatheCausalLM
from lathe.models.frozen import frozen_copy
from lathe.rollout.hf import HFRollout

log = logging.getLogger("lathe")
KEY = "actor_rollout_ref.rollout.name"
VERL_BACKENDS = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TensorRT-LLM"}


def runs_lathe(model) -> bool:
    """Whether lathe's engine can run `model` (lathe's decoder or its VL model)."""
    return isinstance(model, LatheCausalLM) or is_vl(model)


def architecture(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "architecture", None) or type(model).__name__


def resolve_rollout_name(name: str, actor, *, impl: str) -> str:
    """`lathe` or `hf` for `rollout.name` (`auto` and verl's backends resolved by what the actor runs); logs the
    start-up's one 'rollout:' line saying which and why (a Rollout is built once per process, and worker ranks
    other than 0 log warnings only, so the line, and a verl backend's notice in it, appears once per run).

    The engine runs lathe's decoder, so it needs an actor that `select_impl` turned into one.
    """
    arch, is_lathe = architecture(actor), runs_lathe(actor)
    if name == "lathe" and not is_lathe:
        why = ("actor_rollout_ref.model.impl=hf" if impl == "hf"
               else f"lathe's decoder does not implement {arch} (see the 'actor:' log line)")
        raise ValueError(f"{KEY}=lathe: lathe's engine runs lathe's own decoder (it covers "
                         f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} and the VL models), but the actor runs "
                         f"transformers {arch} because {why}. Fix: set {KEY}=hf (or auto) to generate with transformers"
                         + (", or set actor_rollout_ref.model.impl=auto." if impl == "hf" else "."))
    if name not in ("auto", "lathe", "hf", *VERL_BACKENDS):
        raise ValueError(f"{KEY}={name!r} is not a lathe rollout backend; use auto, lathe or hf")
    if name in VERL_BACKENDS:
        why = backend_notice(name, None if is_lathe else arch)
    elif name == "auto":
        why = (f"{KEY}=auto and lathe's decoder runs {arch}" if is_lathe
               else f"{KEY}=auto and the actor runs transformers {arch}")
    else:
        why = f"{KEY}={name}"
    if name == "auto" or name in VERL_BACKENDS:
        name = "lathe" if is_lathe else "hf"
    log.info("rollout: %s (%s)", "lathe engine" if name == "lathe" else "transformers generate", why)
    return name


def backend_notice(name: str, fallback_arch: str | None = None) -> str:
    """The notice for a verl backend name: lathe's engine runs in its place (or transformers generate, for an
    architecture lathe's decoder does not implement: `fallback_arch`)."""
    label = VERL_BACKENDS[name]
    engine = (f"lathe runs its own engine, not {label}" if fallback_arch is None else
              f"lathe does not run {label}, and lathe's decoder does not implement {fallback_arch}, so transformers "
              f"generate runs it")
    return (f"{KEY}={name}: {engine}; the engine keys act on lathe's engine (gpu_memory_utilization, "
            f"max_num_seqs, max_num_batched_tokens, max_model_len, enforce_eager, free_cache_engine, "
            f"enable_chunked_prefill, enable_prefix_caching, cudagraph_capture_sizes, and engine_kwargs.{name}'s "
            f"entries with a lathe meaning); {KEY}=auto picks the same backend without this notice")


def eos_token_ids(tokenizer, model) -> list[int]:
    """The ids that end a response: the tokenizer's eos, then any other eos of the model's generation_config.

    Chat checkpoints often list several (Qwen2.5-Instruct: `<|im_end|>` and `<|endoftext|>`).
    """
    ids: list[int] = []
    gen_cfg = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(gen_cfg, "eos_token_id", None)):
        for i in [] if value is None else [value] if isinstance(value, int) else value:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def build_engine(rollout_cfg, actor: LatheCausalLM, eos_ids: list[int], *, engine_model=None,
                 standalone: bool = False, **engine_kwargs) -> LatheEngine:
    """lathe's engine over `actor`'s weights in the rollout dtype, on the actor's device: the actor's own tensors
    when they already are in that dtype (mixed-precision training on CUDA), else a frozen copy; or over
    `engine_model` when given (a copy made beforehand: a sharded actor's, a LoRA actor's merged layers, a replica's).
    `standalone`: a replica of a rollout pool of its own, sized by standalone_gpu_memory_utilization when set.
    `engine_kwargs`: further `LatheEngine` arguments (the judge's eager, unfused engine over offloaded weights)."""
    if engine_model is None:
        engine_model = frozen_copy(actor, rollout_dtype(rollout_cfg.dtype, actor.device), actor.device, share=True)
    max_model_len = rollout_cfg.max_model_len or rollout_cfg.prompt_length + rollout_cfg.response_length
    utilization = rollout_cfg.gpu_memory_utilization
    if standalone and rollout_cfg.standalone_gpu_memory_utilization is not None:
        utilization = rollout_cfg.standalone_gpu_memory_utilization
    quantization = getattr(rollout_cfg, "quantization", None)      # (a judge's rollout group has none)
    if quantization:
        log.info("rollout: %s projections in the engine (actor_rollout_ref.rollout.quantization=%s); the gap to "
                 "the trainer's log-probs is reported as training/rollout_probs_diff_* whenever the old-log-prob "
                 "pass runs (with algorithm.rollout_correction on: token-level TIS unless it is configured, or "
                 "rollout.quantization_correction=false)", quantization.upper(), quantization)
    if engine_kwargs.get("num_speculative_tokens"):
        log.info("rollout: speculative decoding, %d drafts per step from the policy's first MTP layer "
                 "(actor_rollout_ref.model.mtp.enable_rollout=true; eager steps; acceptance in rollout/spec_*)",
                 engine_kwargs["num_speculative_tokens"])
    return LatheEngine(engine_model, eos_token_id=eos_ids,
                       gpu_memory_utilization=utilization,
                       max_num_seqs=rollout_cfg.max_num_seqs, max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
                       max_model_len=max_model_len, enable_prefix_caching=rollout_cfg.enable_prefix_caching,
                       enable_chunked_prefill=rollout_cfg.enable_chunked_prefill,
                       enforce_eager=rollout_cfg.enforce_eager,
                       cudagraph_capture_sizes=rollout_cfg.cudagraph_capture_sizes,
                       quantization=quantization, quantize_lm_head=getattr(rollout_cfg, "quantize_lm_head", False),
                       kv_cache_dtype=getattr(rollout_cfg, "kv_cache_dtype", None),
                       shared_prefix_attention=getattr(rollout_cfg, "shared_prefix_attention", True),
                       record_routing=bool(getattr(rollout_cfg, "enable_rollout_routing_replay", False)),
                       **engine_kwargs)


def build_hf_rollout(rollout_cfg, model, eos_ids: list[int], pad_id: int, device: torch.device, *,
                     own_copy: bool) -> HFRollout:
    """transformers `generate` on `model`; `own_copy`: the module is the rollout's own (written only by weight
    syncs), moved to the device in the rollout dtype and frozen."""
    if own_copy:
        model.requires_grad_(False)
        cast_keeping_rope(model, rollout_dtype(rollout_cfg.dtype, device), device)
    return HFRollout(model, eos_token_id=eos_ids, pad_token_id=pad_id, max_num_seqs=rollout_cfg.max_num_seqs or 1024)
