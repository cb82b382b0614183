"""The rollout part of a colocated worker: a backend over the actor's weights, asleep between rollouts on a GPU.

The backend (`lathe.rollout.build`) is lathe's engine over the actor's own tensors when they are in the rollout
dtype (mixed precision on CUDA: one copy of the weights serves training and rollout), else over a copy of its own;
or transformers' `generate`, sharing the actor's module when the actor runs transformers on one device. Either way
it receives the actor's weights (same names) after every update and checkpoint load (`update_weights`).

A tensor-parallel replica (`rollout.tensor_model_parallel_size` > 1) generates on all its ranks at once. Single-turn
generation is the same call on each (their schedulers agree: the same prompts, seeds and cache size). The multi-turn
agent loop adds each trajectory's next turn when its tools answer, which is not at the same moment on two ranks: it
runs on the replica's first rank alone, over the engine seen through the replica's lockstep (`lathe.workers.lockstep`,
as fully-async replicas run), so each tool call runs once per replica and every rank takes the same requests at the
same step; the other ranks follow.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from lathe.batch import Batch
from lathe.config.rules_mtp import speculative_tokens
from lathe.device import reset_peak_memory, synchronize
from lathe.dtypes import rollout_dtype
from lathe.engine.data_parallel import engine_groups, engine_layout
from lathe.engine.tensor_parallel import TensorParallel, shard_copy
from lathe.generation import SamplingParams
from lathe.models.frozen import frozen_copy
from lathe.models.lora import merged_weights
from lathe.rollout.agent import agent_columns, agent_kwargs, check_agent_names
from lathe.rollout.agent.custom import custom_loops_in
from lathe.rollout.base import to_batch
from lathe.rollout.build import build_engine, build_hf_rollout, eos_token_ids, resolve_rollout_name
from lathe.workers.actor import Actor
from lathe.workers.colocated_stream import ColocatedStream
from lathe.workers.lockstep import Lockstep, ReplicaEngine, control_groups


class Rollout:
    """Generation beside the actor. Construct it before `Actor.start_training` (a sharded actor's full weights are
    copied then), and call `start` after it, so that the engine sizes its KV cache from the memory left."""

    def __init__(self, rollout_cfg, actor: Actor, loaded, tokenizer):
        """`loaded`: the policy as loaded (a transformers module when `select_impl` converted it)."""
        self.cfg, self.actor, self.tokenizer, self.device = rollout_cfg, actor, tokenizer, actor.device
        self.name = resolve_rollout_name(rollout_cfg.name, actor.model, impl=actor.arr.model.impl)
        if rollout_cfg.quantization and self.name != "lathe":
            raise ValueError(f"actor_rollout_ref.rollout.quantization={rollout_cfg.quantization} quantises lathe's "
                             f"engine, but this policy generates with transformers (see the 'rollout:' log line). "
                             "Fix: set actor_rollout_ref.rollout.quantization=null.")
        kv_dtype = getattr(rollout_cfg, "kv_cache_dtype", "auto")
        if kv_dtype != "auto" and self.name != "lathe":
            raise ValueError(f"actor_rollout_ref.rollout.kv_cache_dtype={kv_dtype} is lathe's engine's FP8 KV cache, "
                             "but this policy generates with transformers (see the 'rollout:' log line). Fix: set "
                             "actor_rollout_ref.rollout.kv_cache_dtype=auto (and no engine_kwargs kv_cache_dtype).")
        self.eos_ids = eos_token_ids(tokenizer, loaded)
        self.hf_model = None if self.name == "lathe" else loaded    # lathe's engine: the transformers module is dropped
        fp8 = actor.arr.actor.fsdp_config.fp8_training
        if fp8 and self.name == "hf" and loaded is actor.model and not actor.sharded:
            raise ValueError(f"actor_rollout_ref.actor.fsdp_config.fp8_training={fp8}: transformers' generate would "
                             "share the actor's module and so sample through its FP8 layers. Fix: use lathe's engine "
                             "(rollout.name=lathe, model.impl=lathe: an architecture lathe's decoder implements), or "
                             "remove fp8_training.")
        self.engine_model = None
        self.backend = self.agent = None
        self.free_cache_engine = False
        self.tp = TensorParallel(None, 0, 1)
        self.dp = None              # data-parallel attention: this replica's place among its engine's
        self.replica: Lockstep | None = None        # a tensor-parallel replica's agent loop: its ranks in lockstep
        self._control = None
        self.stream: ColocatedStream | None = None  # colocate_async: requests streamed across steps
        if actor.sharded:       # the rollout's own copy, before sharding, to the device tensor by tensor
            state = merged_weights(actor.model) if actor.lora else None
            dtype = rollout_dtype(rollout_cfg.dtype, self.device)
            # (data-parallel attention: replicas in lockstep, the experts over all their ranks)
            dp_size, ep_size = engine_layout(actor.model, rollout_cfg)
            if self.name == "lathe" and rollout_cfg.tensor_model_parallel_size * dp_size > 1:   # this rank's slices
                self.tp, dp = engine_groups(rollout_cfg.tensor_model_parallel_size, dp_size)
                self.dp = dp if dp.size > 1 else None
                self.engine_model = shard_copy(actor.model, dtype, self.device, self.tp, state=state,
                                               expert_parallel_size=ep_size, dp=dp,
                                               keep_mtp=speculative_tokens(actor.arr) > 0)
                if (rollout_cfg.multi_turn.enable or custom_loops_in(rollout_cfg)) and self.tp.size > 1:
                    # (collective: every rank builds its replica's group at once; replicas of one rank under
                    # data-parallel attention need none)
                    self._control = control_groups(self.tp.size, lockstep_timeout(actor.arr))
            elif self.name == "lathe":
                self.engine_model = frozen_copy(actor.model, dtype, self.device, state=state)
            if self.name == "hf" and loaded is actor.model:      # transformers generate: a copy of its own
                self.hf_model = (frozen_copy(actor.model, actor.policy.master_dtype, torch.device("cpu"), state=state)
                                 if actor.lora else copy.deepcopy(actor.model))

    def start(self, agent: Callable | None = None) -> None:
        """Build the backend (and the agent loop over it, `agent(engine)`); asleep on a GPU with
        `free_cache_engine`. LoRA on one device: the engine's own copies of the adapted layers, the rest shared."""
        actor, cfg = self.actor, self.cfg
        if self.name == "lathe":
            if actor.lora and not actor.sharded:
                self.engine_model = frozen_copy(actor.model, rollout_dtype(cfg.dtype, self.device), self.device,
                                                share=True, state=merged_weights(actor.model))
            self.backend = build_engine(cfg, actor.model, self.eos_ids, engine_model=self.engine_model,
                                        num_speculative_tokens=speculative_tokens(actor.arr))
        else:
            self.backend = build_hf_rollout(cfg, self.hf_model, self.eos_ids, self.tokenizer.pad_token_id,
                                            self.device, own_copy=self.hf_model is not actor.model)
        # the engine's KV cache lives only while generating (colocated on one GPU); on CPU it stays allocated
        self.free_cache_engine = self.name == "lathe" and cfg.free_cache_engine and self.device.type == "cuda"
        if actor.lora and actor.arr.model.lora_adapter_path:
            self.update_weights(actor.weights())   # a transformers rollout's own copy starts from the base
        if agent is not None:
            if self.name != "lathe":
                raise NotImplementedError(
                    "actor_rollout_ref.rollout.multi_turn.enable=true needs lathe's engine (rollout.name=lathe), "
                    f"which streams each turn; this run generates with {self.name} (see the 'rollout:' log line), "
                    "for which the agent loop is not implemented")
            if self._control is not None:           # the leader's loop drives its followers' engines
                self.replica = Lockstep(self.backend, self.tp, self._control,
                                        timeout_s=lockstep_timeout(self.actor.arr))
                self.agent = agent(ReplicaEngine(self.replica)) if self.replica.leader else None
            else:
                self.agent = agent(self.backend)
        if self.free_cache_engine:
            self.backend.sleep()

    def generate_sequences(self, prompts: Batch, params: SamplingParams, *, first_index: int = 0) -> Batch | None:
        """Sample `params.n` responses per prompt; returns the prompt rows repeated n times plus the tensors.
        `first_index`: where this share's first sample sits in a rollout split over ranks (seeding). The ranks of a
        tensor-parallel replica all generate (the same samples); only its first returns them, the others None."""
        prompt_ids = [list(p) for p in prompts["prompt_ids"]]
        if "agent_name" in prompts:                 # (rows naming verl's agent loops: ones this run has)
            check_agent_names(prompts, self.cfg)
        if not prompt_ids and self.dp is None:      # (called with none only as a data-parallel-attention engine's
            return None                             # idle replica)
        images = {"multi_modal_inputs": list(prompts["multi_modal_inputs"])} if "multi_modal_inputs" in prompts else {}
        if self.stream is not None:                 # colocate_async: beside the streamed requests (validation)
            out = self.stream.generate(prompt_ids, params, first_index=first_index, **images,
                                       agent=agent_kwargs(prompts, self.agent) if self.agent is not None else None)
            return None if self.tp.rank else self._rows(prompts, prompt_ids, out, params, {})
        timings = {}
        if self.actor.sharded:                 # a step starts here: its peak memory is reported by the update
            reset_peak_memory(self.device)
        if self.free_cache_engine:
            with self._timed(timings, "timing_s/rollout_wake_up"):
                self.backend.wake_up()
        try:
            if self.replica is not None:    # (a follower returns None, having followed the leader's loop; a leader
                # with no prompts, a replica of data-parallel attention, serves the others' steps)
                out = self.replica.run(lambda: self.agent.serve_replicas() if not prompt_ids else self.agent.generate(
                    prompt_ids, params, first_index=first_index, **agent_kwargs(prompts, self.agent), **images))
            elif not prompt_ids:    # an idle replica: its experts serve the other replicas' steps, its KV cache awake
                out = None          # so that every replica replays decode graphs (an asleep one makes all eager)
                self.agent.serve_replicas() if self.agent is not None else self.backend.generate([], params)
            elif self.agent is not None:
                out = self.agent.generate(prompt_ids, params, first_index=first_index,
                                          **agent_kwargs(prompts, self.agent), **images)
            else:
                out = self.backend.generate(prompt_ids, params, first_index=first_index, **images)
        finally:
            if self.free_cache_engine:
                with self._timed(timings, "timing_s/rollout_sleep"):
                    self.backend.sleep()
        if self.tp.rank or out is None:
            return None
        return self._rows(prompts, prompt_ids, out, params, timings)

    def _rows(self, prompts: Batch, prompt_ids: list[list[int]], out, params: SamplingParams, timings: dict) -> Batch:
        """The prompt rows repeated `n` times with the responses' tensors, the agent loop's columns, the metrics."""
        gen = to_batch(prompt_ids, out, self.tokenizer.pad_token_id, params.n)
        batch = prompts.repeat(params.n, interleave=True).update(gen)
        if self.agent is not None:
            batch.update(agent_columns(out, batch["extra_info"]))
            if getattr(out, "prompt_ids", None):        # a custom agent loop's prompts (`to_batch` took them)
                batch["prompt_ids"] = [list(p) for p in out.prompt_ids]
        batch.meta["rollout_metrics"] = {**out.metrics, **timings}   # the engine's own (preemptions, cache, graphs)
        return batch

    def update_weights(self, named_tensors) -> None:
        """Load (name, tensor) pairs into the backend (a no-op for tensors the two already share)."""
        if self.stream is not None:
            raise RuntimeError("Rollout.update_weights while requests stream across steps (colocate_async): their "
                               "tokens need the new weights' version; use stream_weights")
        self.backend.update_weights(named_tensors)

    # -- colocate_async: the engine's requests streamed across training steps (`lathe.workers.colocated_stream`) --
    def stream_run(self, requests: list[tuple], max_steps: int) -> dict:
        """Add requests and run up to `max_steps` engine steps; the finished requests' rows (`ColocatedStream.run`)."""
        return self._stream().run(requests, max_steps)

    def stream_pause(self) -> int:
        """Interrupt the unfinished samples and sleep (`ColocatedStream.pause`); how many were interrupted."""
        return self.stream.pause() if self.stream is not None else 0

    def stream_weights(self, named_tensors, version: int) -> None:
        """The actor's weights into the engine as weight `version` (`ColocatedStream.load_weights`)."""
        self._stream().load_weights(named_tensors, version)

    def _stream(self) -> ColocatedStream:
        if self.stream is None:
            if self.name != "lathe" or self.replica is not None or self.dp is not None:
                raise NotImplementedError(
                    "trainer.v1.trainer_mode=colocate_async streams requests through lathe's engine; this rollout "
                    f"runs {self.name!r}{' with an agent loop on a tensor-parallel replica' if self.replica else ''}"
                    f"{' with data-parallel attention' if self.dp else ''} (see the 'rollout:' log line). Fix: train "
                    "with trainer.v1.trainer_mode=sync, or use a model lathe's decoder implements "
                    "(actor_rollout_ref.model.impl=auto) without data-parallel attention (and agent loops on an "
                    "engine of one device a replica).")
            self.stream = ColocatedStream(self.backend, self.tokenizer.pad_token_id, wake=self._stream_wake,
                                          sleep=self._stream_sleep, agent=self.agent,
                                          answer_timeout_s=lockstep_timeout(self.actor.arr))
        return self.stream

    def _stream_wake(self, timings: dict) -> None:
        if self.free_cache_engine:
            with self._timed(timings, "timing_s/rollout_wake_up"):
                self.backend.wake_up()

    def _stream_sleep(self, timings: dict) -> None:
        if self.free_cache_engine:
            with self._timed(timings, "timing_s/rollout_sleep"):
                self.backend.sleep()

    @contextmanager
    def _timed(self, into: dict, key: str):
        """Seconds of the block added to `into[key]`, the device's queued work included (it syncs before and after).
        (Added: colocate_async's stream keeps its wake-ups' and sleeps' seconds until a finished request carries
        them, which may be after a second sleep.)"""
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        into[key] = into.get(key, 0.0) + time.perf_counter() - start


def lockstep_timeout(arr) -> float:
    """Seconds a rank of a tensor-parallel replica waits for the others' lockstep messages: `nccl_timeout`, and
    beyond a tool call's limit (an idle leader waits for its tools up to `multi_turn.tool_timeout` + 5 s between
    two messages)."""
    return max(float(arr.nccl_timeout), arr.rollout.multi_turn.tool_timeout + 60.0)
