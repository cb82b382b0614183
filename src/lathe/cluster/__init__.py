"""Placing workers: in-process for one device; Ray placement groups and worker groups for many.

`start_cluster` is what `lathe train` calls when `trainer.nnodes x trainer.n_gpus_per_node > 1`: it starts (or
joins) Ray, reserves one bundle per device, starts one rank per bundle in one process group, builds the
actor/rollout/reference worker (and the critic) on every rank, and returns the driver-side groups that the
loop calls exactly as it calls the in-process workers. A learned reward model or judge (`reward_model.enable`) is
colocated with the actor on those ranks, or, with `reward_model.enable_resource_pool`, placed on a pool of its own
(`reward_model.nnodes x reward_model.n_gpus_per_node` devices, one whole copy on each: verl's reward pool), which
scores each step's responses while the trainer's devices hold only the actor's models. The distillation teachers
likewise: on the trainer's ranks like the reference, or, with `distillation.nnodes` and `n_gpus_per_node` >= 1, on a
group of their own (`teacher_pool`, one whole copy of every teacher per rank: verl's teacher pool).

`start_sft_cluster` is `lathe sft`'s: the same ranks running `SFTWorker`s.

`start_async_cluster` is its fully-asynchronous counterpart (`RunPlan.is_async`): two pools, the trainer's ranks
without engines and the rollout replicas (`lathe.workers.fully_async`, driven through `cluster/async_roles.py`),
joined by the checkpoint engine's process group (`lathe.workers.checkpoint_engine`) for the weight sync. A learned
reward model (or judge) and the distillation teachers live on the trainer's ranks, colocated with the actor, or each
on a third (fourth) group of its own as in the synchronous cluster (`reward_pool`, `teacher_pool`), started beside
the other two: either way the trainer thread scores each batch just before the update
(`lathe.loop.fully_async_learn.learn_batch`), and the trainer's ranks then hold only the actor's models.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lathe.config import LatheConfig, RunPlan
from lathe.config.rules_mtp import speculative_tokens

log = logging.getLogger("lathe")
REWARD_POOL = "reward_model"           # the reward model's own pool and group (its keys' prefix too)
TEACHER_POOL = "teacher"               # the distillation teachers' own pool and group


@dataclass
class Cluster:
    group: object                  # RayWorkerGroup
    actor: object                  # ActorRolloutRefGroup
    critic: object | None          # CriticGroup
    started_ray: bool
    args: tuple = ()               # what start_cluster was given (to start the same workers again)
    reward_model: object | None = None   # RewardModelGroup (reward_model.enable)
    reward_group: object | None = None   # RayWorkerGroup of the reward model's own pool (enable_resource_pool)
    teacher_group: object | None = None  # RayWorkerGroup of the teachers' own pool (distillation.nnodes)

    @property
    def groups(self) -> list:
        """Every worker group of the run (the profiler covers each one's ranks)."""
        return [self.group] + [g for g in (self.reward_group, self.teacher_group) if g is not None]

    def close(self) -> None:
        for group in reversed(self.groups):
            group.shutdown()
        if self.started_ray:
            import ray
            ray.shutdown()

    def restart(self) -> Cluster:
        """Stop every rank (the dead one included) and start the same workers afresh, on their starting
        weights; the caller then loads a checkpoint into them."""
        self.close()
        cfg, plan, kwargs = self.args
        return start_cluster(cfg, plan, **kwargs)


def _group(cfg, device_type: str, name: str, timeout_s: float, build) -> tuple[object, bool]:
    """Ray joined or started, one bundle per trainer device, a worker group built by `build(group)`; on failure
    everything started is released before the error goes on."""
    from lathe.cluster.placement import start_ray
    t = cfg.trainer
    started = start_ray(cfg)
    try:
        group = _own_pool(name, t.nnodes, t.n_gpus_per_node, device_type, timeout_s, build, pool_key="trainer")
    except BaseException:
        if started:
            import ray
            ray.shutdown()
        raise
    return group, started


def start_sft_cluster(cfg, *, model_path: str, load_kwargs: dict, tokenizer, total_steps: int,
                      device_type: str) -> Cluster:
    from lathe.cluster.roles import SFT, SFTGroup
    from lathe.workers.build import build_sft_worker
    group, started = _group(cfg, device_type, "sft", 600.0, lambda g: g.build(
        SFT, build_sft_worker, cfg, model_path, load_kwargs, tokenizer, total_steps=total_steps,
        device_type=device_type))
    return Cluster(group, SFTGroup(group, balance=cfg.trainer.balance_batch), None, started)


def start_cluster(cfg: LatheConfig, plan: RunPlan, *, model_path: str, load_kwargs: dict, tokenizer, total_steps: int,
                  device_type: str) -> Cluster:
    """One worker group over the trainer's devices (`plan.devices`): the actor/rollout/reference worker (and the
    critic) colocated on every rank; the reward model and the teachers there too, or each on a group of its own
    (`reward_pool`, `teacher_pool`)."""
    from lathe.cluster.roles import ACTOR, CRITIC, ActorRolloutRefGroup, CriticGroup
    from lathe.workers.build import build_actor_rollout_ref, build_critic

    def build(group) -> None:
        group.build(ACTOR, build_actor_rollout_ref, cfg, plan, model_path, load_kwargs, tokenizer,
                    total_steps=total_steps, device_type=device_type)
        if plan.critic is not None:
            group.build(CRITIC, build_critic, cfg, plan, tokenizer, total_steps=total_steps, device_type=device_type)
        if not own_pool:
            build_reward_model_on(group, cfg, plan, tokenizer, device_type)

    own_pool = has_reward_pool(cfg)
    timeout = cfg.actor_rollout_ref.nccl_timeout
    group, started = _group(cfg, device_type, "actor_rollout_ref", timeout, build)
    rm_group = None
    try:
        rm_group = reward_pool(cfg, plan, tokenizer, device_type, timeout) if own_pool else None
        teachers = teacher_pool(cfg, plan, tokenizer, device_type, timeout) if plan.teacher_devices else None
        actor, critic = _driver_groups(cfg, plan, group, tokenizer, ActorRolloutRefGroup, CriticGroup,
                                       teacher_group=teachers)
    except BaseException:
        if rm_group is not None:
            rm_group.shutdown()
        group.shutdown()
        if started:
            import ray
            ray.shutdown()
        raise
    return Cluster(group, actor, critic, started,
                   args=(cfg, plan, dict(model_path=model_path, load_kwargs=load_kwargs, tokenizer=tokenizer,
                                         total_steps=total_steps, device_type=device_type)),
                   reward_model=reward_model_group(cfg, rm_group or group), reward_group=rm_group,
                   teacher_group=teachers)


def has_reward_pool(cfg: LatheConfig) -> bool:
    """The reward model (or judge) runs on devices of its own (`reward_model.enable_resource_pool`), not on the
    trainer's."""
    rm = cfg.reward_model
    return bool(rm.enable and rm.enable_resource_pool)


def reward_pool(cfg: LatheConfig, plan: RunPlan, tokenizer, device_type: str, timeout_s: float):
    """The reward model's own worker group: `reward_model.nnodes x reward_model.n_gpus_per_node` ranks (Ray must be
    up), a whole reward model (or judge) on each, every wait bounded by `timeout_s`; on failure whatever it placed is
    released before the error goes on."""
    rm = cfg.reward_model
    return _own_pool(REWARD_POOL, rm.nnodes, rm.n_gpus_per_node, device_type, timeout_s,
                     lambda group: build_reward_model_on(group, cfg, plan, tokenizer, device_type))


def teacher_pool(cfg: LatheConfig, plan: RunPlan, tokenizer, device_type: str, timeout_s: float):
    """The distillation teachers' own worker group: `distillation.nnodes x distillation.n_gpus_per_node` ranks (Ray
    must be up), a whole copy of every teacher on each (`TeacherWorker`), every wait bounded by `timeout_s`; on
    failure whatever it placed is released before the error goes on."""
    from lathe.workers.build import build_teacher
    d = cfg.distillation
    return _own_pool(TEACHER_POOL, d.nnodes, d.n_gpus_per_node, device_type, timeout_s,
                     lambda group: group.build(TEACHER_POOL, build_teacher, cfg, plan, tokenizer,
                                               device_type=device_type), sizes_key="distillation")


def _own_pool(name: str, nnodes: int, per_node: int, device_type: str, timeout_s: float, build, *,
              pool_key: str | None = None, sizes_key: str | None = None, **group_kwargs):
    """A worker group `name` over a pool of its own (`nnodes` x `per_node` bundles), its workers made by
    `build(group)`; on failure the group (or the bare pool) is released before the error goes on. `pool_key`: the
    config group whose nnodes / n_gpus_per_node size the pool (its placement then waits `ResourcePool`'s own
    deadline), else `name` (waiting `timeout_s`; `sizes_key`: the config group that a placement failure names, where
    it is not `name`). `group_kwargs`: `RayWorkerGroup`'s."""
    from lathe.cluster.placement import ResourcePool
    from lathe.cluster.worker_group import RayWorkerGroup
    placement = {"name": pool_key} if pool_key else {"name": name, "timeout_s": timeout_s, "key": sizes_key}
    pool = group = None
    try:
        pool = ResourcePool(nnodes, per_node, use_gpu=device_type == "cuda", **placement)
        group = RayWorkerGroup(pool, name=name, timeout_s=timeout_s, **group_kwargs)
        build(group)
    except BaseException:
        if group is not None:
            group.shutdown()
        elif pool is not None:
            pool.release()
        raise
    return group


def build_reward_model_on(group, cfg: LatheConfig, plan: RunPlan, tokenizer, device_type: str) -> None:
    """With `reward_model.enable`, the reward model on every rank of `group` (colocated with the actor, or the
    reward model's own pool: each rank scores its share of a step's responses)."""
    from lathe.cluster.roles import REWARD_MODEL
    from lathe.workers.build import build_reward_model
    if cfg.reward_model.enable:
        group.build(REWARD_MODEL, build_reward_model, cfg, plan, tokenizer, device_type=device_type)


def reward_model_group(cfg: LatheConfig, group):
    """The driver's handle on `build_reward_model_on`'s reward models (None without `reward_model.enable`)."""
    from lathe.cluster.roles import RewardModelGroup
    return RewardModelGroup(group, balance=cfg.trainer.balance_batch) if cfg.reward_model.enable else None


def _driver_groups(cfg: LatheConfig, plan: RunPlan, group, tokenizer, actor_cls, critic_cls, **actor_kwargs):
    """The driver's handles on a group's actor and critic, each update cut into the plan's mini-batches."""
    from lathe.engine.data_parallel import verl_expert_layout
    balance = cfg.trainer.balance_batch
    actor = actor_cls(group, pad_id=tokenizer.pad_token_id, balance=balance, has_ref=plan.needs_ref,
                      rollout_lockstep=verl_expert_layout(cfg.actor_rollout_ref.rollout),
                      has_teacher=cfg.distillation.enabled,
                      mini_batch_size=plan.actor.mini_batch_sequences, rollout_tp=plan.rollout_tp,
                      actor_sp=plan.actor.group_size, keep_groups=cfg.actor_rollout_ref.actor.use_prefix_grouper,
                      ref_sp=plan.ref_sequence_parallel_size * plan.ref_tensor_parallel_size,
                      **actor_kwargs)
    critic = (critic_cls(group, mini_batch_size=plan.critic.mini_batch_sequences, balance=balance,
                         sp=plan.critic.group_size) if plan.critic is not None else None)
    return actor, critic


@dataclass
class AsyncCluster:
    """Fully-async training's pools: the trainer's worker group and the rollout replicas, the weight sync between
    them (a process group of the trainer's rank 0 and every replica), and the reward model's and the teachers' own
    groups where they have one."""

    trainer_group: object          # RayWorkerGroup (AsyncTrainerWorker on every rank)
    rollout_group: object          # RayWorkerGroup (RolloutWorker on every rank)
    actor: object                  # AsyncActorGroup
    critic: object | None
    rollout: object                # RolloutGroup
    started_ray: bool
    metas: list
    bucket_bytes: int
    position_metas: list | None = None   # tensor-parallel replicas: each position's slices (a resharding sync)
    args: tuple | None = None            # (cfg, plan, start_async_cluster's keywords): what `restart` starts again
    reward_model: object | None = None   # RewardModelGroup over its own pool, else the trainer's ranks
    reward_group: object | None = None   # RayWorkerGroup of the reward model's own pool (enable_resource_pool)
    teacher_group: object | None = None  # RayWorkerGroup of the teachers' own pool (distillation.nnodes)

    @property
    def groups(self) -> list:
        """Every worker group of the run."""
        return [self.trainer_group, self.rollout_group] + [g for g in (self.reward_group, self.teacher_group)
                                                           if g is not None]

    def restart(self) -> AsyncCluster:
        """Stop every pool (the dead rank included) and start them afresh on their starting weights; the caller then
        loads a checkpoint into the trainer, and the replicas take its weights at the first sync."""
        self.close()
        cfg, plan, kwargs = self.args
        import lathe.cluster
        return lathe.cluster.start_async_cluster(cfg, plan, **kwargs)

    def sync(self, version: int) -> dict:
        """Broadcast the trainer's weights to every (paused) replica; they take `version`."""
        what = "weight sync"
        sends = self.trainer_group.submit_each("actor_rollout_ref", "send_weights",
                                               [((self.metas, self.bucket_bytes), {})] * self.trainer_group.world_size)
        receives = self.rollout_group.submit_each("rollout", "receive_weights", self.rollout.leaders(
            [((self.metas, self.bucket_bytes, version, self.position_metas), {})] * self.rollout.world))
        # (their followers too)
        stats = self.trainer_group.gather(sends, what, watching=self.rollout_group)[0]   # (a failed receiver)
        self.rollout_group.gather(receives, what)
        return stats

    def close(self) -> None:
        """Stop the replicas' engine threads and close the weight sync on both sides at once: closing an NCCL
        communicator waits for every rank of it to close too, so the replicas closing alone waited out
        actor_rollout_ref.nccl_timeout at the end of every run on GPUs (gloo does not wait). After a rollout rank
        failed, the replicas do not wait for their engine threads, which may wait for it inside a collective."""
        try:
            failed = next((g.failure for g in self.groups if getattr(g, "failure", None)), None)   # (any pool's)
            stop = ((), {"failed": failed} if failed else {})
            replicas = self.rollout_group.submit_each("rollout", "shutdown", [stop] * self.rollout_group.world_size)
            sender = self.trainer_group.submit_each("actor_rollout_ref", "close_sync",
                                                    [((), {})] * self.trainer_group.world_size)
            self.rollout_group.gather(replicas, "rollout.shutdown")
            self.trainer_group.gather(sender, "close_sync")
        except Exception:      # noqa: BLE001 - shutting down (maybe after a failure): the groups are stopped next
            pass
        for group in reversed(self.groups):
            group.shutdown()
        if self.started_ray:
            import ray
            ray.shutdown()


def start_async_cluster(cfg: LatheConfig, plan: RunPlan, *, model_path: str, load_kwargs: dict, tokenizer,
                        total_steps: int, device_type: str) -> AsyncCluster:
    """The trainer pool (`trainer.nnodes x n_gpus_per_node`, FSDP2, no engine; the reward model and the teachers
    colocated on every rank unless they have a pool of their own) and the rollout pool (`rollout.nnodes x
    n_gpus_per_node` replicas of lathe's engine), joined for the weight sync; the reward model's (`reward_pool`) and
    the teachers' (`teacher_pool`) own groups where asked. Every pool loads at once; when one fails, the others are
    stopped before the error goes on."""
    from lathe.cluster.async_roles import RolloutGroup
    from lathe.cluster.placement import start_ray
    from lathe.cluster.roles import ACTOR, CRITIC, AsyncActorGroup, CriticGroup
    from lathe.workers.build import build_async_trainer, build_critic, build_rollout_replica
    from lathe.workers.fully_async import ROLLOUT
    t, arr = cfg.trainer, cfg.actor_rollout_ref
    timeout, own_rm = arr.nccl_timeout, has_reward_pool(cfg)

    def build_trainer(group) -> None:
        group.build(ACTOR, build_async_trainer, cfg, plan, model_path, load_kwargs, tokenizer,
                    total_steps=total_steps, device_type=device_type)       # (no teacher with a teacher pool)
        if plan.critic is not None:
            group.build(CRITIC, build_critic, cfg, plan, tokenizer, total_steps=total_steps, device_type=device_type)
        if not own_rm:
            build_reward_model_on(group, cfg, plan, tokenizer, device_type)

    def build_replicas(group) -> None:
        group.build(ROLLOUT, build_rollout_replica, cfg, model_path, load_kwargs, tokenizer, device_type=device_type)

    r = cfg.rollout
    starts = {"trainer": lambda: _own_pool("trainer", t.nnodes, t.n_gpus_per_node, device_type, timeout,
                                           build_trainer, pool_key="trainer"),
              "rollout": lambda: _own_pool("rollout", r.nnodes, r.n_gpus_per_node, device_type, timeout,
                                           build_replicas, pool_key="rollout", max_concurrency=5)}  # (one: the watch)
    if own_rm:
        starts[REWARD_POOL] = lambda: reward_pool(cfg, plan, tokenizer, device_type, timeout)
    if plan.teacher_devices:
        starts[TEACHER_POOL] = lambda: teacher_pool(cfg, plan, tokenizer, device_type, timeout)
    started = start_ray(cfg)
    with ThreadPoolExecutor(len(starts), thread_name_prefix="lathe-pool") as starting:   # all pools load at once
        futures = {name: starting.submit(start) for name, start in starts.items()}
    groups = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            if f.exception() is not None:
                raise f.exception()      # (each failed pool released itself: `_own_pool`)
        trainer, rollout = groups["trainer"], groups["rollout"]
        rm_group, teachers = groups.get(REWARD_POOL), groups.get(TEACHER_POOL)
        replicas = RolloutGroup(rollout, pad_id=tokenizer.pad_token_id, timeout_s=timeout,
                                tp=arr.rollout.tensor_model_parallel_size)
        replicas.watch()
        actor, critic_group = _driver_groups(cfg, plan, trainer, tokenizer, AsyncActorGroup, CriticGroup,
                                             replicas=replicas, teacher_group=teachers)
        metas = trainer.call(ACTOR, "weight_metas")[0]
        ce = cfg.async_training.checkpoint_engine
        megabytes = ce.device_buffer_size_M or arr.rollout.update_weights_bucket_megabytes
        bucket_bytes = megabytes << 20 if ce.enable else 1          # enable=false: every tensor a bucket of its own
        # data-parallel attention: each replica's experts are its own, so whole tensors go to every rank, which keeps
        # its slices (one group)
        from lathe.engine.data_parallel import verl_expert_layout
        tp = 1 if verl_expert_layout(arr.rollout) else arr.rollout.tensor_model_parallel_size
        ports: set[int] = set()
        while len(ports) < tp:              # one group per tensor-parallel position (`lathe.workers.reshard`)
            ports.add(trainer.free_port())
        _join_sync_group(trainer, rollout, trainer.nodes[0]["ip"], sorted(ports), timeout,
                         expert_parallel_size=arr.rollout.expert_parallel_size,
                         keep_mtp=speculative_tokens(arr) > 0)
        position_metas = trainer.call(ACTOR, "position_metas", metas)[0] if tp > 1 else None
        log.info("fully async: %d trainer rank(s), %d rollout replica(s); weight sync of %.2f GB in %s%s",
                 trainer.world_size, replicas.world, sum(m.nbytes for m in metas) / 1e9,
                 f"buckets of {megabytes} MB" if ce.enable else "one bucket per tensor",
                 "" if position_metas is None else ", %.2f GB to each rollout rank" % (
                     max(sum(m.nbytes for m in p) for p in position_metas) / 1e9))
    except BaseException:
        for g in reversed(list(groups.values())):
            g.shutdown()
        if started:
            import ray
            ray.shutdown()
        raise
    return AsyncCluster(trainer, rollout, actor, critic_group, replicas, started, metas, bucket_bytes, position_metas,
                        args=(cfg, plan, dict(model_path=model_path, load_kwargs=load_kwargs, tokenizer=tokenizer,
                                              total_steps=total_steps, device_type=device_type)),
                        reward_model=reward_model_group(cfg, rm_group or trainer), reward_group=rm_group,
                        teacher_group=teachers)


def _join_sync_group(trainer, rollout, host: str, port: int | list[int], timeout_s: float,
                     expert_parallel_size: int = 1, keep_mtp: bool = False) -> None:
    """The trainer's rank 0 and every rollout rank join the weight sync: one group of all (one port), or with
    tensor-parallel replicas of T ranks (T ports) T groups, group p of the rank 0 and the ranks at position p of
    every replica (rank 1 + i: replica i). `keep_mtp`: the replicas hold the MTP layers whole (speculative
    decoding), so the resharding sync sends them whole."""
    ports = port if isinstance(port, list) else [port]
    tp = len(ports)
    world = 1 + rollout.world_size // tp
    a = trainer.submit_each("actor_rollout_ref", "join_sync_group",
                            [((host, port, 0, world, timeout_s, expert_parallel_size), {"keep_mtp": keep_mtp})]
                            * trainer.world_size)
    b = rollout.submit_each("rollout", "join_sync_group", [((host, ports[r % tp], 1 + r // tp, world, timeout_s), {})
                                                           for r in range(rollout.world_size)])
    trainer.gather(a, "join_sync_group")
    rollout.gather(b, "join_sync_group")
