"""What each rank of a worker group builds (`RayWorkerGroup.build` runs these inside the rank's process): the role
workers on the starting weights every rank loads alike, seeded alike."""

from __future__ import annotations

from lathe.config import LatheConfig, RunPlan
from lathe.config.sft import sft_mesh
from lathe.device import rank_device
from lathe.dtypes import rollout_dtype
from lathe.models.hf import load_policy
from lathe.seeding import seed_everything
from lathe.workers.sft import SFTWorker
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker, TeacherWorker
from lathe.workers.critic import CriticWorker
from lathe.workers.fully_async import AsyncTrainerWorker, RolloutWorker
from lathe.workers.judge import JudgeWorker
from lathe.workers.reward_model import RewardModelWorker, micro_batch_size


def build_actor_rollout_ref(cfg: LatheConfig, plan: RunPlan, model_path: str, load_kwargs: dict, tokenizer, *,
                            total_steps: int, device_type: str):
    """The actor/rollout/reference worker of this rank."""
    seed_everything(cfg.trainer.seed)
    return ActorRolloutRefWorker(cfg, load_policy(model_path, **load_kwargs), tokenizer, plan=plan,
                                 total_steps=total_steps, device=rank_device(device_type))


def build_async_trainer(cfg: LatheConfig, plan: RunPlan, model_path: str, load_kwargs: dict, tokenizer, *,
                        total_steps: int, device_type: str):
    """A trainer rank of fully-async training: the actor/reference worker without an engine, and the sending side
    of the weight sync."""
    seed_everything(cfg.trainer.seed)
    device = rank_device(device_type)
    worker = ActorRolloutRefWorker(cfg, load_policy(model_path, **load_kwargs), tokenizer, plan=plan,
                                   total_steps=total_steps, device=device, rollout=False)
    return AsyncTrainerWorker(worker, rollout_dtype(cfg.actor_rollout_ref.rollout.dtype, device))


def build_rollout_replica(cfg: LatheConfig, model_path: str, load_kwargs: dict, tokenizer, *, device_type: str):
    """A rollout replica of fully-async training: lathe's engine on this rank's device."""
    return RolloutWorker(cfg, model_path, load_kwargs, tokenizer, device_type=device_type)


def build_critic(cfg: LatheConfig, plan: RunPlan, tokenizer, *, total_steps: int, device_type: str):
    seed_everything(cfg.trainer.seed)
    return CriticWorker(cfg, tokenizer, plan=plan.critic, total_steps=total_steps, device=rank_device(device_type),
                        mesh=plan.mesh("critic"))


def build_reward_model(cfg: LatheConfig, plan: RunPlan, tokenizer, *, device_type: str | None = None,
                       device=None):
    """The reward model of this rank (a whole copy: each rank scores its share of the responses): the generative
    judge with `reward_model.judge.enable`, else the sequence-classification model. `device`: one process's device
    (else this rank's device of `device_type`)."""
    device = device if device is not None else rank_device(device_type)
    if cfg.reward_model.judge.enable:
        return JudgeWorker(cfg, tokenizer, device=device)
    return RewardModelWorker(cfg, tokenizer, device=device, micro_batch_size=micro_batch_size(cfg, plan))


def build_teacher(cfg: LatheConfig, plan: RunPlan, tokenizer, *, device_type: str):
    """A rank of the distillation teachers' own pool: every teacher, a whole copy on this rank's device."""
    seed_everything(cfg.trainer.seed)
    return TeacherWorker(cfg, tokenizer, plan=plan, device=rank_device(device_type))


def build_sft_worker(cfg, model_path: str, load_kwargs: dict, tokenizer, *, total_steps: int, device_type: str):
    """`lathe sft`'s worker of this rank."""
    seed_everything(cfg.trainer.seed)
    return SFTWorker(cfg, load_policy(model_path, **load_kwargs), tokenizer, total_steps=total_steps,
                     device=rank_device(device_type), mesh=sft_mesh(cfg))
