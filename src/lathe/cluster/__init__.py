"""Placing workers: in-process for one device; Ray placement groups and worker groups for many.

`start_cluster` is what `lathe train` calls when `trainer.nnodes x trainer.n_gpus_per_node > 1`: it starts (or
joins) Ray, reserves one bundle per device, starts one rank per bundle in one process group, builds the
actor/rollout/reference worker (and the critic) on every rank, and returns the driver-side groups that the
loop calls exactly as it calls the in-process workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("lathe")


@dataclass
class Cluster:
    group: object                  # RayWorkerGroup
    actor: object                  # ActorRolloutRefGroup
    critic: object | None          # CriticGroup
    started_ray: bool
    args: tuple = ()               # what start_cluster was given (to start the same workers again)

    def close(self) -> None:
        self.group.shutdown()
        if self.started_ray:
            import ray
            ray.shutdown()

    def restart(self) -> Cluster:
        """Stop every rank (the dead one included) and start the same workers afresh, on their starting
        weights; the caller then loads a checkpoint into them."""
        self.close()
        cfg, kwargs = self.args
        return start_cluster(cfg, **kwargs)


def start_cluster(cfg, *, model_path: str, load_kwargs: dict, tokenizer, total_steps: int, device_type: str,
                  need_ref: bool, critic: bool) -> Cluster:
    from lathe.cluster.placement import ResourcePool, start_ray
    from lathe.cluster.roles import (ACTOR, CRITIC, ActorRolloutRefGroup, CriticGroup, build_actor_rollout_ref,
                                     build_critic)
    from lathe.cluster.worker_group import RayWorkerGroup
    t, arr = cfg.trainer, cfg.actor_rollout_ref
    started = start_ray(cfg)
    pool = group = None
    try:
        pool = ResourcePool(t.nnodes, t.n_gpus_per_node, use_gpu=device_type == "cuda")
        group = RayWorkerGroup(pool, name="actor_rollout_ref", timeout_s=arr.nccl_timeout)
        group.build(ACTOR, build_actor_rollout_ref, cfg, model_path, load_kwargs, tokenizer, total_steps=total_steps,
                    device_type=device_type, need_ref=need_ref)
        n = arr.rollout.n
        actor = ActorRolloutRefGroup(group, pad_id=tokenizer.pad_token_id, balance=t.balance_batch,
                                     mini_batch_size=arr.actor.ppo_mini_batch_size * n, has_ref=need_ref)
        critic_group = None
        if critic:
            group.build(CRITIC, build_critic, cfg, tokenizer, total_steps=total_steps, device_type=device_type)
            critic_group = CriticGroup(group, mini_batch_size=cfg.critic.ppo_mini_batch_size * n,
                                       balance=t.balance_batch)
    except BaseException:
        if group is not None:
            group.shutdown()
        elif pool is not None:
            pool.release()
        if started:
            import ray
            ray.shutdown()
        raise
    return Cluster(group, actor, critic_group, started,
                   args=(cfg, dict(model_path=model_path, load_kwargs=load_kwargs, tokenizer=tokenizer,
                                   total_steps=total_steps, device_type=device_type, need_ref=need_ref,
                                   critic=critic)))
