"""The actor/rollout/reference worker: every call takes a `Batch` and returns one (or metrics).

This is the unit a cluster places: in one process it is a plain object; on Ray it becomes a worker
group behind the same methods. It owns the policy weights, the optimizer, the frozen reference
copy and the rollout backend.

Actor and reference run lathe's own decoder when it implements the architecture
(`actor_rollout_ref.model.impl`, see `lathe.models.hf.select_impl`). The rollout backend
(`actor_rollout_ref.rollout.name`, `auto` by default) is then:

- `lathe`: lathe's paged engine (`lathe.engine.llm_engine.LatheEngine`) over its own copy of the actor's
  decoder in `rollout.dtype` (float32 on CPU); the transformers module is dropped. `auto` picks it
  whenever the actor runs lathe's decoder.
- `hf`: transformers `generate` on the transformers module the worker was given. When the actor is that
  module they share it and nothing is copied; otherwise the module is the rollout's own copy.

Either way the rollout receives the actor's weights (same names) after every update and checkpoint load.

Precision (`lathe.train.precision`, verl's `fsdp_config.{model_dtype, mixed_precision}`): on CUDA the actor
computes in bf16 on fp32 master weights kept by its optimizer (`MasterAdamW`); the engine then runs on the
actor's own bf16 tensors (one copy of the weights serves training and rollout, and the weight sync only
drops the prefix cache). The reference is a frozen bf16 copy, in pinned CPU memory between uses with
`ref.fsdp_config.param_offload`. CPU runs train in fp32 as before.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from lathe.algo import ROLLOUT_CORRECTION_KEYS
from lathe.batch import Batch
from lathe.device import reset_peak_memory, synchronize
from lathe.dtypes import short_name
from lathe.engine.llm_engine import LatheEngine
from lathe.engine.multimodal import is_vl
from lathe.generation import SamplingParams
from lathe.train.vl import check_vl, freeze_vision_tower
from lathe.models.compile import maybe_compile
from lathe.models.decoder import LatheCausalLM
from lathe.models.hf import select_impl
from lathe.models.io import load_into
from lathe.models.lora import (adapters_disabled, apply_lora, load_adapter, merge_and_unload, merged_weights,
                               read_adapter)
from lathe.rollout.agent import agent_columns
from lathe.rollout.base import to_batch
from lathe.rollout.hf import HFRollout
from lathe.train import lora, parallel
from lathe.train.actor import PPOActor, use_torch_compile
from lathe.train.logprob import batched_log_probs
from lathe.train.offload import HostWeights, offload_flags
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.precision import resolve_policy
from lathe.train.update import load_policy_checkpoint, nonfinite_guard, save_policy_checkpoint

log = logging.getLogger("lathe")
ROLLOUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ActorRolloutRefWorker:
    def __init__(self, cfg, model, tokenizer, *, total_steps: int, device: torch.device, need_ref: bool,
                 rollout: bool = True):
        """`model`: the policy as loaded (lathe's decoder or a transformers module, in its load dtype, any device).
        `rollout=False`: no rollout backend (fully-async training generates on devices of its own)."""
        arr = cfg.actor_rollout_ref
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        hf_model = model
        self.model = select_impl(model, arr.model.impl, role="actor")
        if is_vl(self.model):
            check_vl(self.model, arr, rollout=rollout)
        self.lora = arr.model.lora_rank > 0 and self._apply_lora()
        self.remove_padding = arr.model.use_remove_padding
        self.rollout_name = resolve_rollout_name(arr.rollout.name, self.model, impl=arr.model.impl) if rollout else None
        if (isinstance(self.model, LatheCausalLM) or is_vl(self.model)) and arr.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.policy = resolve_policy(arr.actor.fsdp_config, device, key="actor_rollout_ref.actor.fsdp_config")
        self.sharded = parallel.in_group()             # a rank of a data-parallel group: FSDP2
        if self.lora and not rollout:
            raise NotImplementedError("actor_rollout_ref.model.lora_rank > 0 with a rollout pool of its own (fully "
                                      "async: the weight sync sends full weights) is not implemented yet; train "
                                      "LoRA synchronously (rollout.n_gpus_per_node=0)")
        # LoRA: the reference is the actor with its adapters off (no second copy of the weights)
        self.lora_ref = self.lora and need_ref
        self.ref, self.ref_host = self._build_ref(arr, need_ref and not self.lora)   # from the weights as loaded
        # sharded: the weights stay in host memory until fully_shard moves each layer's shard to the device (the
        # whole model is never on the device)
        if self.lora:            # the frozen base computes in param_dtype (bf16 on a GPU); only the adapters train
            lora.place(self.model, self.policy, device, sharded=self.sharded)
        else:
            self.model.to(device=None if self.sharded else device, dtype=self.policy.master_dtype)
        if arr.actor.freeze_vision_tower:
            freeze_vision_tower(self.model, self.policy.param_dtype, sharded=self.sharded)
        # LoRA: the engine generates from the merged weights (no adapters of its own)
        merged = (lambda: merged_weights(self.model)) if self.lora else (lambda: None)
        if self.sharded:         # the rollout's own full copy goes to the device tensor by tensor
            self.engine_model = (frozen_copy(self.model, rollout_dtype(arr.rollout.dtype, device), device,
                                             state=merged()) if self.rollout_name == "lathe" else None)
            if hf_model is self.model:        # transformers generate: a copy of its own
                hf_model = (frozen_copy(self.model, self.policy.master_dtype, torch.device("cpu"), state=merged())
                            if self.lora else copy.deepcopy(self.model))
            parallel.shard(self.model, arr.actor.fsdp_config, self.policy, device)
            self.optimizer = build_optimizer(self.model.parameters(), arr.actor.optim)   # fp32 shards (LoRA: adapters)
        else:                    # LoRA: the engine's own copies of the adapted layers, the rest shared
            self.engine_model = (frozen_copy(self.model, rollout_dtype(arr.rollout.dtype, device), device, share=True,
                                             state=merged()) if self.lora and self.rollout_name == "lathe" else None)
            self.optimizer = build_optimizer(self.model.parameters(), arr.actor.optim, policy=self.policy,
                                             **offload_flags(arr.actor.fsdp_config, device,
                                                             key="actor_rollout_ref.actor.fsdp_config"))
        self.scheduler = build_scheduler(self.optimizer, arr.actor.optim, total_steps)
        log.info("actor: %s on %s", self.policy.describe(), device)
        self.actor = PPOActor(self.model, self.optimizer, self.scheduler, arr.actor, n=arr.rollout.n,
                              temperature=arr.rollout.temperature,
                              max_response_length=cfg.data.max_response_length,
                              rollout_correction={k: getattr(cfg.algorithm.rollout_correction, k)
                                                  for k in ROLLOUT_CORRECTION_KEYS},
                              use_remove_padding=self.remove_padding, nonfinite=nonfinite_guard(cfg, "actor"))
        self.log_prob_micro_batch_size = (arr.rollout.log_prob_micro_batch_size_per_gpu
                                          or self.actor.micro_batch_size)
        # last, so that the engine sizes its KV cache from the memory that actor and reference leave
        self.rollout = (self._build_rollout(arr.rollout, hf_model, eos_token_ids(tokenizer, hf_model)) if rollout
                        else None)
        # the engine's KV cache lives only while generating (colocated on one GPU); on CPU it stays allocated
        self.free_cache_engine = (self.rollout_name == "lathe" and arr.rollout.free_cache_engine
                                  and device.type == "cuda")
        if self.lora and arr.model.lora_adapter_path and self.rollout is not None:
            self.sync_weights()          # a transformers rollout's own copy starts from the base: give it the adapter
        self.agent = self._build_agent(cfg) if self.rollout is not None and arr.rollout.multi_turn.enable else None
        if self.free_cache_engine:
            self.rollout.sleep()

    def _build_agent(self, cfg):
        """The multi-turn agent loop over the engine (`rollout.multi_turn.enable`), with the run's tools."""
        from lathe.rollout.agent import build_agent_loop
        if self.rollout_name != "lathe":
            raise NotImplementedError(
                "actor_rollout_ref.rollout.multi_turn.enable=true needs lathe's engine (rollout.name=lathe), which "
                f"streams each turn; this run generates with {self.rollout_name} (see the 'rollout:' log line), "
                "for which the agent loop is not implemented")
        return build_agent_loop(cfg, self.rollout, self.tokenizer)

    def _apply_lora(self) -> bool:
        """Adapters on the targeted layers (`lathe.models.lora`), from `lora_adapter_path` when given."""
        m, seed = self.cfg.actor_rollout_ref.model, self.cfg.trainer.seed
        if not (isinstance(self.model, LatheCausalLM) or is_vl(self.model)):
            raise ValueError("actor_rollout_ref.model.lora_rank > 0 needs lathe's decoder (Llama, Qwen2, Qwen3), but "
                             f"the actor runs transformers {_architecture(self.model)}. Fix: set lora_rank=0, or use "
                             "an architecture lathe's decoder implements.")
        names = apply_lora(self.model, rank=m.lora_rank, alpha=m.lora_alpha, target_modules=m.target_modules,
                           exclude_modules=m.exclude_modules, dropout=m.lora_dropout, seed=seed)
        if m.lora_adapter_path:
            _, tensors = read_adapter(m.lora_adapter_path)
            load_adapter(self.model, tensors, f"actor_rollout_ref.model.lora_adapter_path={m.lora_adapter_path}")
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        log.info("actor: LoRA rank %d on %d layers: %.2fM trainable parameters of %.1fM", m.lora_rank, len(names),
                 trained / 1e6, sum(p.numel() for p in self.model.parameters()) / 1e6)
        return True

    def _build_ref(self, arr, need_ref: bool):
        """The frozen reference: a copy of the actor in the ref's compute dtype, compiled like the actor; with
        `ref.fsdp_config.param_offload` its weights wait in pinned CPU memory (`HostWeights`) between uses."""
        if not need_ref:
            return None, None
        key = "actor_rollout_ref.ref.fsdp_config"
        policy = resolve_policy(arr.ref.fsdp_config, self.device, key=key, trainable=False)
        # sharded: built in host memory, fully_shard moves each rank's shards to the device
        ref = frozen_copy(self.model, policy.param_dtype, torch.device("cpu") if self.sharded else self.device)
        offload = offload_flags(arr.ref.fsdp_config, self.device, key=key, frozen=True)["offload_params"]
        if self.sharded:
            parallel.shard(ref, arr.ref.fsdp_config, policy, self.device)
        maybe_compile(ref, use_torch_compile(arr.ref), device=self.device)
        log.info("reference: %s weights%s", short_name(policy.param_dtype), ", in CPU memory between uses" * offload)
        return ref, (HostWeights(ref, self.device) if offload and not self.sharded else None)

    def _build_rollout(self, rollout_cfg, hf_model, eos_ids: list[int]):
        """The engine over the actor's weights (the transformers module is then dropped), or HF generate."""
        if self.rollout_name == "lathe":
            return build_engine(rollout_cfg, self.model, eos_ids, engine_model=self.engine_model)
        if hf_model is not self.model:      # the rollout's own copy: written by sync_weights only
            hf_model.requires_grad_(False)
            hf_model.to(device=self.device, dtype=rollout_dtype(rollout_cfg.dtype, self.device))
        return HFRollout(hf_model, eos_token_id=eos_ids, pad_token_id=self.tokenizer.pad_token_id,
                         max_num_seqs=rollout_cfg.max_num_seqs or 1024)

    # -- rollout ------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Batch, params: SamplingParams, *, first_index: int = 0) -> Batch:
        """Sample `params.n` responses per prompt; returns the prompt rows repeated n times plus the tensors.
        `first_index`: where this share's first sample sits in a rollout split over ranks (see `Rollout`)."""
        prompt_ids = [list(p) for p in prompts["prompt_ids"]]
        timings = {}
        if self.sharded:                       # a step starts here: its peak memory is reported by update_actor
            reset_peak_memory(self.device)
        if self.free_cache_engine:
            with self._timed(timings, "timing_s/rollout_wake_up"):
                self.rollout.wake_up()
        # image prompts (VL): each prompt's {pixel_values, image_grid_thw}, None for text prompts
        images = {"multi_modal_inputs": list(prompts["multi_modal_inputs"])} if "multi_modal_inputs" in prompts else {}
        try:
            if self.agent is not None:
                extra = prompts["extra_info"]
                out = self.agent.generate(prompt_ids, params, first_index=first_index,
                                          tools_kwargs=[(x or {}).get("tools_kwargs") for x in extra],
                                          interaction_kwargs=[(x or {}).get("interaction_kwargs") for x in extra],
                                          messages=list(prompts["raw_prompt"]), **images)
            else:
                out = self.rollout.generate(prompt_ids, params, first_index=first_index, **images)
        finally:
            if self.free_cache_engine:
                with self._timed(timings, "timing_s/rollout_sleep"):
                    self.rollout.sleep()
        gen = to_batch(prompt_ids, out, self.tokenizer.pad_token_id, params.n)
        batch = prompts.repeat(params.n, interleave=True).update(gen)
        if self.agent is not None:
            batch.update(agent_columns(out, batch["extra_info"]))
        batch.meta["rollout_metrics"] = {**out.metrics, **timings}   # the engine's own (preemptions, cache, graphs)
        return batch

    @contextmanager
    def _timed(self, into: dict, key: str):
        """Seconds of the block into `into[key]`, the device's queued work included (it syncs before and after)."""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        into[key] = time.perf_counter() - start

    # -- log-probs ------------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the responses (`old_log_probs`) and their entropy."""
        ro = self.cfg.actor_rollout_ref.rollout
        logp, ent = batched_log_probs(self.model, batch.to(self.device), micro_batch_size=self.log_prob_micro_batch_size,
                                      temperature=ro.temperature, calculate_entropy=True,
                                      remove_padding=self.remove_padding, **_token_budget(ro, "rollout"))
        return Batch({"old_log_probs": logp.cpu(), "entropys": ent.cpu()})

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        ref_cfg = self.cfg.actor_rollout_ref.ref
        micro = ref_cfg.log_prob_micro_batch_size_per_gpu or self.log_prob_micro_batch_size
        with (adapters_disabled(self.model) if self.lora_ref else
              self.ref_host.on_device() if self.ref_host is not None else nullcontext(self.ref)) as ref:
            logp, _ = batched_log_probs(ref, batch.to(self.device), micro_batch_size=micro,
                                        temperature=self.cfg.actor_rollout_ref.rollout.temperature,
                                        remove_padding=self.remove_padding, **_token_budget(ref_cfg, "ref"))
        return Batch({"ref_log_prob": logp.cpu()})

    # -- training -------------------------------------------------------------------------------
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One PPO update of the actor; the rollout keeps the old weights until `sync_weights`. A rank of a group
        adds the step's peak memory (since its rollout began), the largest over the ranks."""
        out = self.actor.update_policy(batch.to(self.device))
        return {**out, **parallel.peak_memory_metrics(self.device)} if self.sharded else out

    def sync_weights(self) -> None:
        """Push the actor's weights into the rollout (a no-op for tensors the two already share). Sharded: one FSDP2
        group (a decoder layer) is gathered, copied into the engine and freed at a time (no second full model).
        LoRA: only the adapted layers, merged (`lathe.train.lora.engine_weights`)."""
        if self.rollout is None:                # no engine here: the fully-async driver sends the weights
            return
        if self.lora:                           # only the adapted layers change: their merged weights
            self.rollout.update_weights(lora.engine_weights(self.model))
            return
        self.rollout.update_weights(parallel.full_tensors(self.model) if self.sharded
                                    else self.model.state_dict().items())

    @property
    def has_ref(self) -> bool:
        return self.ref is not None or self.lora_ref

    # -- checkpoint -----------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """HF-format weights (loadable by transformers) and tokenizer, plus optimizer and scheduler state
        (sharded: every rank gathers, rank 0 writes)."""
        save_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, self.tokenizer,
                    base_model=self.cfg.actor_rollout_ref.model.path)

    def load_checkpoint(self, path: Path) -> None:
        load_policy_checkpoint(path, self.model, self.optimizer, self.scheduler, what="actor")
        self.sync_weights()


def resolve_rollout_name(name: str, actor, *, impl: str) -> str:
    """`lathe` or `hf` for `rollout.name` (`auto` resolved by what the actor runs); logs which and why.

    The engine runs lathe's decoder, so it needs an actor that `select_impl` turned into one.
    """
    key, arch = "actor_rollout_ref.rollout.name", _architecture(actor)
    is_lathe = isinstance(actor, LatheCausalLM) or is_vl(actor)      # the engine runs both
    if name == "lathe" and not is_lathe:
        why = ("actor_rollout_ref.model.impl=hf" if impl == "hf"
               else f"lathe's decoder does not implement {arch} (see the 'actor:' log line)")
        raise ValueError(f"{key}=lathe: lathe's engine runs lathe's own decoder, but the actor runs transformers "
                         f"{arch} because {why}. Fix: set {key}=hf (or auto) to generate with transformers"
                         + (", or set actor_rollout_ref.model.impl=auto." if impl == "hf" else "."))
    if name not in ("auto", "lathe", "hf"):
        raise ValueError(f"{key}={name!r} is not a lathe rollout backend; use auto, lathe or hf")
    if name == "auto":
        name = "lathe" if is_lathe else "hf"
        why = (f"{key}=auto and lathe's decoder runs {arch}" if is_lathe
               else f"{key}=auto and the actor runs transformers {arch}")
    else:
        why = f"{key}={name}"
    log.info("rollout: %s (%s)", "lathe engine" if name == "lathe" else "transformers generate", why)
    return name


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


def rollout_dtype(name: str, device: torch.device) -> torch.dtype:
    """`rollout.dtype` on CUDA; float32 on CPU (bf16 matmuls there are slow and lose the trainer's numerics)."""
    if device.type != "cuda":
        return torch.float32
    if name not in ROLLOUT_DTYPES:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={name!r}; use one of {', '.join(ROLLOUT_DTYPES)}")
    return ROLLOUT_DTYPES[name]


def build_engine(rollout_cfg, actor: LatheCausalLM, eos_ids: list[int], *, engine_model=None) -> LatheEngine:
    """lathe's engine over `actor`'s weights in the rollout dtype, on the actor's device: the actor's own tensors
    when they already are in that dtype (mixed-precision training on CUDA), else a frozen copy; or over
    `engine_model` when given (the copy a sharded actor made before sharding)."""
    if engine_model is None:
        engine_model = frozen_copy(actor, rollout_dtype(rollout_cfg.dtype, actor.device), actor.device, share=True)
    max_model_len = rollout_cfg.max_model_len or rollout_cfg.prompt_length + rollout_cfg.response_length
    return LatheEngine(engine_model, eos_token_id=eos_ids,
                       gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                       max_num_seqs=rollout_cfg.max_num_seqs, max_num_batched_tokens=rollout_cfg.max_num_batched_tokens,
                       max_model_len=max_model_len, enable_prefix_caching=rollout_cfg.enable_prefix_caching,
                       enable_chunked_prefill=rollout_cfg.enable_chunked_prefill,
                       enforce_eager=rollout_cfg.enforce_eager)


def frozen_copy(model, dtype: torch.dtype, device: torch.device, *, share: bool = False, state=None):
    """An eval-mode, gradient-free module holding `model`'s weights in `dtype` on `device`.

    lathe's decoder is rebuilt from its state dict tensor by tensor (no second full-precision copy on the way),
    or from `state` ((name, tensor) pairs: a LoRA model's merged weights); with `share`, tensors already in `dtype`
    on `device` are the very same storage (updates show through). A transformers module is deep-copied."""
    if not isinstance(model, LatheCausalLM):    # transformers, or a VL model: a copy (its LoRA layers merged)
        return merge_and_unload(copy.deepcopy(model)).to(device=device, dtype=dtype).requires_grad_(False).eval()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: _as(v.detach(), dtype if v.is_floating_point() else v.dtype, device, share)
             for k, v in (state if state is not None else model.state_dict().items())
             if not (tied and k == "lm_head.weight")}
    with torch.device("meta"):
        out = type(model)(model.config)
    load_into(out, state, "the actor's weights")
    return out.requires_grad_(False).eval()


def _as(t: torch.Tensor, dtype: torch.dtype, device: torch.device, share: bool) -> torch.Tensor:
    if share and t.dtype == dtype and t.device == torch.device(device):
        return t
    return t.to(device=device, dtype=dtype, copy=True)


def _architecture(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "architecture", None) or type(model).__name__


def _token_budget(log_prob_cfg, name: str) -> dict:
    """`batched_log_probs`' token budget from the rollout's or ref's `log_prob_use_dynamic_bsz` keys (none when
    off)."""
    if not log_prob_cfg.log_prob_use_dynamic_bsz:
        return {}
    return {"max_tokens": log_prob_cfg.log_prob_max_token_len_per_gpu,
            "max_tokens_key": f"actor_rollout_ref.{name}.log_prob_max_token_len_per_gpu"}
