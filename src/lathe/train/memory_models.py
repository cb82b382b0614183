"""The memory plan's other models: the reward model, the LLM judge and the distillation teachers.

Each is counted from its checkpoint's config.json (the model built on the meta device, no weight read, counted as
the actor is: `count_params`), in the dtype and at the place its worker really holds it (each only when it is
colocated with the actor: with `reward_model.enable_resource_pool` the reward model or judge, with
`distillation.nnodes` x `n_gpus_per_node` the teachers have devices of their own):

* reward model (`lathe.workers.reward_model`): a whole copy on every rank (not sharded), bf16 on an accelerator
  (fp32 on the CPU); `reward_model.model.fsdp_config.param_offload` keeps it in host memory between calls;
* judge (`lathe.workers.judge`): a whole copy on every rank in `reward_model.rollout.dtype`, under an engine whose
  KV cache is sized when the judge starts (from what is free then: not known here); `param_offload` (CUDA) keeps
  the weights in pinned host memory between calls, `reward_model.rollout.free_cache_engine` frees the cache;
* teachers (`lathe.workers.teacher`): placed like the reference (`actor_rollout_ref.ref.fsdp_config`: its compute
  dtype, an FSDP2 shard when the actor is sharded, host memory with `param_offload`), one part per teacher.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lathe.config.plan import teacher_devices
from lathe.dtypes import rollout_dtype, short_name
from lathe.train.memory import Part, _shard, count_params, model_parts

RM = "reward_model"
REF = "actor_rollout_ref.ref"


def checkpoint_params(path: str, *, classifier: bool = False, trust_remote_code: bool = False) -> int:
    """Parameters of the checkpoint `path` (a directory, a hub id in the cache, or `builtin:<shape>`) from its
    config alone: the model built on the meta device (a vision-language causal LM: with its vision tower).
    `classifier`: as a one-label sequence classifier (the reward model: no LM head, a `score` row instead)."""
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoModelForSequenceClassification)

    from lathe.models.hf import build_builtin_model, checkpoint_config_dir, is_vl_path
    from lathe.models.paths import BUILTIN_PREFIX, is_builtin, resolve
    with torch.device("meta"):
        if is_builtin(path):
            return count_params(build_builtin_model(path[len(BUILTIN_PREFIX):], vocab_size=None))
        if not classifier and is_vl_path(path):          # the policy's loader runs lathe's VL model for these
            from lathe.models.vl import LatheVLForConditionalGeneration, VLConfig
            return count_params(LatheVLForConditionalGeneration(VLConfig.from_pretrained(checkpoint_config_dir(path))))
        config = AutoConfig.from_pretrained(resolve(path), trust_remote_code=trust_remote_code)
        if classifier:
            config.num_labels = 1
        autos = [AutoModelForSequenceClassification] if classifier else [AutoModelForCausalLM,
                                                                          AutoModelForImageTextToText]
        for auto in autos:
            try:
                return count_params(auto.from_config(config, trust_remote_code=trust_remote_code))
            except ValueError:              # transformers: a config this auto class does not build
                if auto is autos[-1]:
                    raise


def _count(path: str, key: str, **kw) -> tuple[int, str]:
    """(parameters, "") of `checkpoint_params`, or (0, why not) when its config cannot be built here: the part
    then says its size is not known up front rather than failing the plan (the worker's load will say more)."""
    try:
        return checkpoint_params(path, **kw), ""
    except Exception as e:   # noqa: BLE001 -- any config transformers cannot build: the plan goes on without it
        return 0, f", size not known up front ({key}={path}: {type(e).__name__}: {str(e)[:120]})"


def other_model_parts(cfg, device, *, world: int = 1, shards: dict[str, int] | None = None) -> list[Part]:
    """The parts of the reward model or judge (`reward_model.enable`) and of each distillation teacher on one of the
    trainer's devices. `world`, `shards`: as `memory.plan` (the teachers shard like the reference). A reward model on
    a pool of its own (`reward_model.enable_resource_pool`), or teachers on theirs (`distillation.nnodes` x
    `n_gpus_per_node`), are not on the trainer's devices: not counted."""
    device = torch.device(device)
    parts = []
    rm = cfg.reward_model
    if rm.enable and not rm.enable_resource_pool:
        parts += judge_parts(cfg, device) if rm.judge.enable else reward_model_parts(cfg, device)
    if cfg.distillation.enabled and not teacher_devices(cfg):
        parts += teacher_parts(cfg, device, ranks=(shards or {}).get("ref", world) if world > 1 else 1)
    return parts


def _offloaded(key: str, on: bool, when: str) -> dict:
    return dict(on_gpu=not on, why=f"{key}=true: {when}" if on else "", offload_key=key)


def reward_model_parts(cfg, device: torch.device) -> list[Part]:
    m = cfg.reward_model.model
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n, unknown = _count(m.path, f"{RM}.model.path", classifier=True, trust_remote_code=m.trust_remote_code)
    key = f"{RM}.model.fsdp_config.param_offload"
    return [Part(f"reward model weights, {short_name(dtype)}, whole on each rank{unknown}", n * dtype.itemsize,
                 **_offloaded(key, bool(m.fsdp_config.param_offload), "on the device only while scoring"))]


def judge_parts(cfg, device: torch.device) -> list[Part]:
    rm = cfg.reward_model
    dtype = rollout_dtype(rm.rollout.dtype, device)
    n, unknown = _count(rm.model.path, f"{RM}.model.path", trust_remote_code=rm.model.trust_remote_code)
    key = f"{RM}.model.fsdp_config.param_offload"
    off = bool(rm.model.fsdp_config.param_offload) and device.type == "cuda"
    weights = Part(f"judge weights, {short_name(dtype)}, whole on each rank{unknown}", n * dtype.itemsize,
                   **_offloaded(key, off, "on the device only while judging"))
    free = rm.rollout.free_cache_engine and device.type == "cuda"
    sized = f"sized at start-up to what {RM}.rollout.gpu_memory_utilization={rm.rollout.gpu_memory_utilization} leaves"
    cache = Part("judge KV cache, size not known up front (not counted)", 0, True,
                 why=f"{sized}; {RM}.rollout.free_cache_engine=true: only while judging" if free else
                 f"{sized}; {RM}.rollout.free_cache_engine=false: held through the update")
    return [weights, cache]


def teacher_parts(cfg, device: torch.device, *, ranks: int) -> list[Part]:
    """One part per teacher, as the reference's (`actor_rollout_ref.ref.fsdp_config`): 1/`ranks` shards when the
    actor is sharded; a sharded teacher is also offloaded by `offload_policy` (FSDP2's CPU offload policy)."""
    from lathe.config.distill import teachers
    arr = cfg.actor_rollout_ref
    fsdp = arr.ref.fsdp_config
    out = []
    for spec in teachers(cfg):
        n, unknown = _count(spec.model_path, f"distillation.teacher_models.{spec.name}.model_path",
                            trust_remote_code=arr.model.trust_remote_code)
        parts = [replace(p, what=p.what + unknown)
                 for p in model_parts(f"teacher {spec.name}", REF, n, fsdp, device, trainable=False)]
        if ranks > 1 and fsdp.offload_policy and not fsdp.param_offload:
            parts = [replace(p, on_gpu=False, why=f"{REF}.fsdp_config.offload_policy=true") for p in parts]
        out += _shard(parts, ranks)
    return out
