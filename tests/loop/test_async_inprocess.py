"""Fully-async training with both pools in this process (no Ray): the driver, the replica's engine thread, the
trainer worker and the weight sync (a gloo `SyncGroup` between two threads) are the real ones; only the worker
groups are in-process stand-ins of `RayWorkerGroup` (one rank each). `in_process_pools` puts them under
`lathe train`, so a test compares an async run with a synchronous one in a few seconds (tests/loop/test_async_*.py);
tests/cluster/test_fully_async.py runs the plain cases over Ray (an FSDP2 trainer rank, the replica in a process of
its own). The trainer here is one unsharded process (with the reward model beside it when `reward_model.enable`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import free_port, warm_started
from lathe.cli import main

FAST = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=4", "trainer.total_training_steps=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[console]"]
ON_POLICY = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false", "data.train_batch_size=0",
             "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
             "async_training.require_batches=1", "async_training.partial_rollout=false",
             "async_training.use_rollout_log_probs=false"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


class LocalGroup:
    """`RayWorkerGroup`'s interface over one in-process rank: calls run here, `submit_each` in a thread (the weight
    sync's two sides must run at once)."""

    def __init__(self, name: str):
        self.name, self.world_size, self.roles = name, 1, {}
        self.nodes = [{"ip": "127.0.0.1"}]
        self.pool = ThreadPoolExecutor(2, thread_name_prefix=f"local-{name}")

    def free_port(self) -> int:
        return free_port()

    def build(self, role: str, factory, *args, **kwargs) -> None:
        self.roles[role] = factory(*args, **kwargs)

    def call(self, role: str, method: str, *args, **kwargs) -> list:
        return [getattr(self.roles[role], method)(*args, **kwargs)]

    def call_each(self, role: str, method: str, per_rank) -> list:
        return self.gather(self.submit_each(role, method, per_rank), method)

    def submit_each(self, role: str, method: str, per_rank) -> list:
        return [None if a is None else self.pool.submit(getattr(self.roles[role], method), *a[0], **a[1])
                for a in per_rank]

    def gather(self, futures: list, what: str, watching=None) -> list:
        return [None if f is None else f.result(timeout=120) for f in futures]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)


def start_in_process(cfg, plan, *, model_path: str, load_kwargs: dict, tokenizer, total_steps: int,
                     device_type: str):
    """`lathe.cluster.start_async_cluster` with both pools in this process."""
    from lathe.cluster import AsyncCluster, _driver_groups, _join_sync_group, build_reward_model_on, reward_model_group
    from lathe.cluster.async_roles import RolloutGroup
    from lathe.cluster.roles import ACTOR, CRITIC, AsyncActorGroup, CriticGroup
    from lathe.workers.build import build_async_trainer, build_critic, build_rollout_replica
    from lathe.workers.fully_async import ROLLOUT
    trainer, rollout = LocalGroup("trainer"), LocalGroup("rollout")
    trainer.build(ACTOR, build_async_trainer, cfg, plan, model_path, load_kwargs, tokenizer, total_steps=total_steps,
                  device_type=device_type)
    if plan.critic is not None:
        trainer.build(CRITIC, build_critic, cfg, plan, tokenizer, total_steps=total_steps, device_type=device_type)
    build_reward_model_on(trainer, cfg, plan, tokenizer, device_type)
    rollout.build(ROLLOUT, build_rollout_replica, cfg, model_path, load_kwargs, tokenizer, device_type=device_type)
    replicas = RolloutGroup(rollout, pad_id=tokenizer.pad_token_id, timeout_s=120)
    actor, critic = _driver_groups(cfg, plan, trainer, tokenizer, AsyncActorGroup, CriticGroup, replicas=replicas)
    _join_sync_group(trainer, rollout, "127.0.0.1", free_port(), 120)
    return AsyncCluster(trainer, rollout, actor, critic, replicas, False, trainer.call(ACTOR, "weight_metas")[0],
                        1 << 20, args=(cfg, plan, dict(model_path=model_path, load_kwargs=load_kwargs,
                                                       tokenizer=tokenizer, total_steps=total_steps,
                                                       device_type=device_type)),
                        reward_model=reward_model_group(cfg, trainer))


@pytest.fixture
def in_process_pools(monkeypatch):
    """`lathe train` with a rollout pool runs both pools in this process (see the module docstring)."""
    import lathe.cluster
    monkeypatch.setattr(lathe.cluster, "start_async_cluster", start_in_process)


def train(run_dir, *overrides: str, warm: int = 30) -> list[dict]:
    """`lathe train` of FAST on the built-in model warm-started `warm` steps (tests/helpers.py): its metrics rows."""
    args = ["train", *FAST, *warm_started(warm), f"trainer.default_local_dir={run_dir}", *overrides]
    assert main(args) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_steps(sync: list[dict], on_policy: list[dict], keys=COMPARED) -> None:
    assert len(sync) == len(on_policy) == 2
    for a, b in zip(sync, on_policy):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
        assert b["fully_async/staleness/max"] == 0

