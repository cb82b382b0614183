"""The actor/rollout/reference worker (verl's `ActorRolloutRefWorker`): every call takes a `Batch` and returns one
(or metrics).

This is the unit a cluster places: in one process it is a plain object; on Ray it becomes a worker group behind
the same methods (`lathe.cluster.roles`). It composes parts built from their own config groups:
`Actor` (`actor_rollout_ref.{model, actor}`: the policy, its optimizer and update), `Reference`
(`actor_rollout_ref.ref`), `Rollout` (`actor_rollout_ref.rollout`: lathe's engine or transformers' generate,
and the agent loop over it) and, with `distillation.enabled`, `Teacher` (the frozen teacher model(s)).
Fully-async training's trainer ranks run it without a rollout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lathe.algo import ROLLOUT_CORRECTION_KEYS
from lathe.batch import Batch
from lathe.config import LatheConfig, RunPlan
from lathe.config.distill import teachers
from lathe.generation import SamplingParams
from lathe.rollout.agent import build_agent_loop
from lathe.rollout.agent.custom import custom_loops_in
from lathe.train.update import nonfinite_guard
from lathe.workers.actor import Actor
from lathe.workers.reference import Reference
from lathe.workers.rollout import Rollout
from lathe.workers.teacher import Teacher, distillation_params


class ActorRolloutRefWorker:
    def __init__(self, cfg: LatheConfig, model, tokenizer, *, plan: RunPlan, total_steps: int,
                 device: torch.device, rollout: bool = True):
        """`model`: the policy as loaded (lathe's decoder or a transformers module, in its load dtype, any device).
        `rollout=False`: no rollout backend (fully-async training generates on devices of its own)."""
        arr, rc = cfg.actor_rollout_ref, cfg.algorithm.rollout_correction
        self.cfg, self.tokenizer, self.device = cfg, tokenizer, device
        self.actor = Actor(arr, model, device=device, seed=cfg.trainer.seed, with_rollout=rollout)
        # the reference copies the weights as loaded, before the actor is sharded
        self.ref = (Reference(arr.ref, self.actor, plan.mesh("ref"), sp_size=plan.ref_sequence_parallel_size)
                    if plan.needs_ref else None)
        distill = distillation_params(cfg.distillation)
        # the teachers here, placed like the reference, unless they have a pool of their own (`TeacherWorker`)
        self.teacher = (Teacher(teachers(cfg), arr, tokenizer, device=device, sharded=self.actor.sharded,
                                mesh=plan.mesh("ref"), seed=cfg.trainer.seed,
                                topk=distill.topk if distill.use_topk else None)
                        if distill is not None and not plan.teacher_devices else None)
        self.rollout = Rollout(arr.rollout, self.actor, model, tokenizer) if rollout else None
        self.actor.start_training(plan=plan.actor, total_steps=total_steps, temperature=arr.rollout.temperature,
                                  max_response_length=cfg.data.max_response_length,
                                  rollout_correction={k: getattr(rc, k) for k in ROLLOUT_CORRECTION_KEYS},
                                  nonfinite=nonfinite_guard(cfg, "actor"), mesh=plan.mesh("actor"),
                                  distillation=distill)
        if self.rollout is not None:            # last: the engine sizes its KV cache from the memory left
            agent = ((lambda engine: build_agent_loop(cfg, engine, tokenizer))
                     if arr.rollout.multi_turn.enable or custom_loops_in(arr.rollout) else None)
            self.rollout.start(agent)
        self.log_prob_micro_batch_size = (arr.rollout.log_prob_micro_batch_size_per_gpu
                                          or self.actor.ppo.micro_batch_size)

    @property
    def model(self):
        """The policy being trained."""
        return self.actor.model

    @property
    def has_ref(self) -> bool:
        return self.ref is not None

    def generate_sequences(self, prompts: Batch, params: SamplingParams, *, first_index: int = 0) -> Batch:
        return self.rollout.generate_sequences(prompts, params, first_index=first_index)

    def compute_log_prob(self, batch: Batch) -> Batch:
        """The current policy's log-probs of the responses (`old_log_probs`) and their entropy."""
        ro = self.cfg.actor_rollout_ref.rollout
        return self.actor.compute_log_prob(batch, micro_batch_size=self.log_prob_micro_batch_size,
                                           temperature=ro.temperature, **_token_budget(ro, "rollout"))

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        arr = self.cfg.actor_rollout_ref
        return self.ref.compute_ref_log_prob(
            batch, micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu or self.log_prob_micro_batch_size,
            temperature=arr.rollout.temperature, **_token_budget(arr.ref, "ref"))

    @property
    def has_teacher(self) -> bool:
        return self.teacher is not None

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """The teachers' log-probs of the responses (`teacher_log_probs`), each row by its own teacher."""
        arr = self.cfg.actor_rollout_ref
        return self.teacher.compute_teacher_log_prob(
            batch, micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu or self.log_prob_micro_batch_size,
            **_token_budget(arr.ref, "ref"))

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One PPO update of the actor; the rollout keeps the old weights until `sync_weights`."""
        return self.actor.update(batch)

    def sync_weights(self) -> None:
        """Push the actor's weights into the rollout (none here: the fully-async driver sends them)."""
        if self.rollout is not None:
            self.rollout.update_weights(self.actor.weights())

    # colocate_async (`lathe.loop.colocate_async`): the engine's requests streamed across steps
    def stream_run(self, requests: list[tuple], max_steps: int) -> dict:
        return self.rollout.stream_run(requests, max_steps)

    def stream_pause(self) -> int:
        return self.rollout.stream_pause()

    def sync_stream_weights(self, version: int) -> None:
        """`sync_weights` for streamed requests: the tokens sampled from now on are of weight `version`."""
        self.rollout.stream_weights(self.actor.weights(), version)

    def save_checkpoint(self, path: Path) -> None:
        self.actor.save_checkpoint(path, self.tokenizer)

    def load_checkpoint(self, path: Path) -> None:
        self.actor.load_checkpoint(path)
        self.sync_weights()


class TeacherWorker:
    """A rank of the teachers' own pool (`distillation.nnodes` x `distillation.n_gpus_per_node`, the synchronous
    loop's): a whole copy of every teacher on this rank's device (no FSDP across the pool: each rank scores its own
    share of a step's rows), placed otherwise like the reference (its compute dtype, `param_offload`), with the
    micro-batches and token budget the colocated teachers use."""

    def __init__(self, cfg: LatheConfig, tokenizer, *, plan: RunPlan, device: torch.device):
        arr = cfg.actor_rollout_ref
        distill = distillation_params(cfg.distillation)
        self.teacher = Teacher(teachers(cfg), arr, tokenizer, device=device, sharded=False, seed=cfg.trainer.seed,
                               topk=distill.topk if distill.use_topk else None)
        self.micro_batch_size = (arr.ref.log_prob_micro_batch_size_per_gpu
                                 or arr.rollout.log_prob_micro_batch_size_per_gpu or plan.actor.micro_batch_per_device)
        self.budget = _token_budget(arr.ref, "ref")

    def compute_teacher_log_prob(self, batch: Batch) -> Batch:
        """As `ActorRolloutRefWorker.compute_teacher_log_prob`, over this rank's share."""
        return self.teacher.compute_teacher_log_prob(batch, micro_batch_size=self.micro_batch_size, **self.budget)


def _token_budget(log_prob_cfg, name: str) -> dict:
    """`batched_log_probs`' token budget from the rollout's or ref's `log_prob_use_dynamic_bsz` keys (none when
    off)."""
    if not log_prob_cfg.log_prob_use_dynamic_bsz:
        return {}
    return {"max_tokens": log_prob_cfg.log_prob_max_token_len_per_gpu,
            "max_tokens_key": f"actor_rollout_ref.{name}.log_prob_max_token_len_per_gpu"}
