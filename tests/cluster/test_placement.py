"""lathe.cluster.placement.check_local_fit: a placement a locally started Ray cluster cannot hold is refused before
anything loads, naming the workers and what the machine has; joining a cluster defers to that cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lathe.cluster.placement import ClusterError, check_local_fit
from lathe.config import load_config, run_plan

pytestmark = pytest.mark.no_ray     # refusals before any Ray starts: either xdist worker (tests/cluster/conftest.py)
FOUR_CPU_WORKERS = ["trainer.device=cpu", "trainer.nnodes=2", "trainer.n_gpus_per_node=2"]


def test_more_workers_than_the_local_cluster_holds_are_refused(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cfg = load_config(None, FOUR_CPU_WORKERS)
    with pytest.raises(ClusterError, match=r"trainer.nnodes=2 x trainer.n_gpus_per_node=2 = 4 workers, one CPU "
                                           r"each, but .* has 2 \(this machine's CPUs\)"):
        check_local_fit(cfg, run_plan(cfg), "cpu", 0)
    async_cfg = load_config(None, ["trainer.device=cpu", "rollout.n_gpus_per_node=2",
                                   "actor_rollout_ref.hybrid_engine=false"])
    with pytest.raises(ClusterError, match=r"rollout.n_gpus_per_node=2 = 3 workers"):
        check_local_fit(async_cfg, run_plan(async_cfg), "cpu", 0)
    with pytest.raises(ClusterError, match=r"one GPU each, but .* has 1"):
        check_local_fit(cfg, run_plan(cfg), "cuda", 1)
    rm_pool = load_config(None, ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "reward_model.enable=true",
                                 "reward_model.model.path=rm", "reward_model.enable_resource_pool=true",
                                 "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"])
    with pytest.raises(ClusterError, match=r"reward_model.nnodes=1 x reward_model.n_gpus_per_node=1 = 3 workers.*"
                                           r"Fix: lower trainer.n_gpus_per_node / trainer.nnodes / "
                                           r"reward_model.n_gpus_per_node"):
        check_local_fit(rm_pool, run_plan(rm_pool), "cpu", 0)
    teachers = load_config(None, ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "distillation.enabled=true",
                                  "distillation.teacher_models.teacher_model.model_path=t", "distillation.nnodes=1",
                                  "distillation.n_gpus_per_node=1"])
    with pytest.raises(ClusterError, match=r"distillation.nnodes=1 x distillation.n_gpus_per_node=1 = 3 workers.*"
                                           r"Fix: lower trainer.n_gpus_per_node / trainer.nnodes / "
                                           r"distillation.n_gpus_per_node"):
        check_local_fit(teachers, run_plan(teachers), "cpu", 0)
    both = load_config(None, ["trainer.device=cpu", "rollout.n_gpus_per_node=1",
                              "actor_rollout_ref.hybrid_engine=false", "reward_model.enable=true",
                              "reward_model.model.path=rm", "reward_model.enable_resource_pool=true",
                              "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1", "distillation.enabled=true",
                              "distillation.teacher_models.teacher_model.model_path=t", "distillation.nnodes=1",
                              "distillation.n_gpus_per_node=1"])         # fully async: four pools of one each
    with pytest.raises(ClusterError, match=r"trainer.n_gpus_per_node=1 \+ rollout.nnodes=1 x rollout.n_gpus_per_node=1"
                                           r" \+ reward_model.nnodes=1 x reward_model.n_gpus_per_node=1 \+ "
                                           r"distillation.nnodes=1 x distillation.n_gpus_per_node=1 = 4 workers.*Fix: "
                                           r"lower trainer.n_gpus_per_node / trainer.nnodes / "
                                           r"rollout.n_gpus_per_node / reward_model.n_gpus_per_node / "
                                           r"distillation.n_gpus_per_node"):
        check_local_fit(both, run_plan(both), "cpu", 0)


def test_a_sized_or_joined_cluster_is_not_second_guessed(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sized = load_config(None, FOUR_CPU_WORKERS + ["ray_kwargs.ray_init.num_cpus=4"])
    check_local_fit(sized, run_plan(sized), "cpu", 0)
    cfg = load_config(None, FOUR_CPU_WORKERS)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_local_fit(cfg, run_plan(cfg), "cpu", 0)


def test_lathe_train_refuses_the_placement_in_seconds_with_one_paragraph(tmp_path):
    """The issue's case: 2 nodes x 2 CPU workers on a machine with fewer CPUs than that, before the warm start."""
    cpus = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-m", "lathe", "train", "trainer.device=cpu", "trainer.nnodes=2",
                          f"trainer.n_gpus_per_node={cpus}", f"data.train_batch_size={2 * cpus}",
                          f"actor_rollout_ref.actor.ppo_mini_batch_size={2 * cpus}",
                          f"trainer.default_local_dir={tmp_path}"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    assert f"= {2 * cpus} workers, one CPU each" in out.stderr and "Traceback" not in out.stderr
    assert "warm start" not in out.stderr, "refused before the model loads"


def test_a_cluster_that_ray_start_left_on_this_machine_is_joined_not_second_guessed(monkeypatch):
    """verl's multi-node recipe: `ray start --head` here, `ray start --address` on the other nodes, then the trainer
    on the head with neither RAY_ADDRESS nor ray_init.address set. `ray.init` joins that cluster (its address file in
    Ray's temp directory), so its size is the cluster's, not this machine's; and start_ray's log says it joined."""
    ray_services = pytest.importorskip("ray._private.services")
    from lathe.cluster.placement import joining_address
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, FOUR_CPU_WORKERS)
    monkeypatch.setattr(ray_services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(ray_services, "find_bootstrap_address", lambda temp_dir: None)
    assert joining_address({}) is None and joining_address({"address": "local"}) is None
    with pytest.raises(ClusterError):
        check_local_fit(cfg, run_plan(cfg), "cpu", 0)
    monkeypatch.setattr(ray_services, "find_bootstrap_address", lambda temp_dir: "10.0.0.2:6379")
    assert joining_address({}) == "10.0.0.2:6379"
    assert joining_address({"address": "local"}) is None            # ray.init(address="local") starts its own
    assert joining_address({"address": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    check_local_fit(cfg, run_plan(cfg), "cpu", 0)
