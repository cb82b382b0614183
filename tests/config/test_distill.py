"""lathe.config.distill: verl's distillation.* keys resolved into teachers and checked before any model loads."""

import warnings

import pytest

from lathe.config import ConfigError, load_config
from lathe.config.distill import DistillationPlacementWarning, teachers
from lathe.config.support import IgnoredKeysWarning

D = "distillation"
ON = [f"{D}.enabled=true"]
ONE = ON + [f"{D}.teacher_models.teacher_model.model_path=/ckpt/teacher"]
TWO = ON + [f"+{D}.teacher_models.gsm8k.key=openai/gsm8k", f"+{D}.teacher_models.gsm8k.model_path=/ckpt/a",
            f"+{D}.teacher_models.geo.key=hiyouga/geometry3k", f"+{D}.teacher_models.geo.model_path=/ckpt/b"]


def load(*overrides: str, devices: int = 1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        warnings.simplefilter("ignore", DistillationPlacementWarning)
        return load_config("base", list(overrides), device_count=devices)


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    return str(err.value)


def test_the_default_entry_is_the_one_teacher_and_takes_every_row():
    cfg = load(*ONE)
    (t,) = teachers(cfg)
    assert (t.name, t.key, t.model_path) == ("teacher_model", None, "/ckpt/teacher")


def test_other_entries_drop_the_default_and_route_by_key():
    cfg = load(*TWO)
    assert {(t.name, t.key, t.model_path) for t in teachers(cfg)} == {
        ("gsm8k", "openai/gsm8k", "/ckpt/a"), ("geo", "hiyouga/geometry3k", "/ckpt/b")}
    # verl's 0.6b script: one named entry beside the default is the only teacher, whatever its key
    (t,) = teachers(load(*ON, f"+{D}.teacher_models.gsm8k.key=openai/gsm8k",
                         f"+{D}.teacher_models.gsm8k.model_path=/ckpt/a"))
    assert (t.name, t.key) == ("gsm8k", None)


def test_a_dropped_default_teacher_with_a_checkpoint_warns():
    with pytest.warns(UserWarning, match="teacher_model.model_path=/ckpt/teacher is dropped"):
        load(*ONE, f"+{D}.teacher_models.gsm8k.model_path=/ckpt/a")


@pytest.mark.parametrize("overrides, words", [
    (ON, "teacher_models.teacher_model.model_path is not set"),
    (ONE + [f"{D}.distillation_loss.loss_mode=k1"], "use_policy_gradient=true"),
    (ONE + [f"{D}.distillation_loss.loss_mode=k7"], "is not a distillation loss"),
    (ONE + [f"{D}.distillation_loss.loss_mode=forward_kl_topk", f"{D}.distillation_loss.topk=0"], "topk=0"),
    (ONE + [f"{D}.distillation_loss.loss_mode=forward_kl_topk", "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2",
            "trainer.device=cpu"], "without sequence parallelism"),
    (ONE + [f"{D}.distillation_loss.policy_loss_mode=gspo"], "PPO's vanilla clipped loss"),
    (ONE + [f"{D}.distillation_loss.loss_max_clamp=0"], "loss_max_clamp=0.0"),
    (ONE + [f"+{D}.teacher_models.teacher_model.inference.max_model_len=100"], "max_model_len=100 is shorter"),
    (TWO + [f"{D}.teacher_key=task"], "teacher_key='task'"),
    (TWO + [f"+{D}.teacher_models.geo.key=openai/gsm8k"], "also the key of teacher gsm8k"),
    (ON + [f"+{D}.teacher_models.a.model_path=/x", f"+{D}.teacher_models.b.model_path=/y"], "teacher_models.a.key"),
])
def test_settings_lathe_cannot_run_are_refused_naming_key_and_fix(overrides, words):
    message = refused(*overrides)
    assert words in message and "Fix" in message


def test_distillation_beside_tensor_parallelism_loads():
    """The teachers are not cut (FSDP2 over the reference's ranks); the student's top k come from its vocabulary
    slices: the actor's and the reference's tensor parallelism load with either loss."""
    tp = ["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2", "trainer.n_gpus_per_node=2",
          "trainer.device=cpu", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.ref.fsdp_config.tensor_parallel_size=2"]
    assert load(*ONE, *tp, devices=2).distillation.enabled
    topk = load(*ONE, *tp, f"{D}.distillation_loss.loss_mode=forward_kl_topk", devices=2)
    assert topk.distillation.distillation_loss.topk == 32


def test_the_top_k_forward_kl_loads():
    assert load(*ONE, f"{D}.distillation_loss.loss_mode=forward_kl_topk").distillation.distillation_loss.topk == 32


@pytest.mark.parametrize("pool", [False, True])
def test_teacher_replica_and_engine_keys_are_named_once(pool):
    sizes = [f"{D}.nnodes=1", f"{D}.n_gpus_per_node=4"] if pool else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("base", [*ONE, *sizes, f"+{D}.teacher_models.teacher_model.num_replicas=2",
                             f"+{D}.teacher_models.teacher_model.inference.tensor_model_parallel_size=2",
                             f"+{D}.teacher_models.teacher_model.inference.max_model_len=4096",
                             f"+{D}.teacher_models.teacher_model.inference.name=vllm"], device_count=1)
    placement = [str(w.message) for w in caught if issubclass(w.category, DistillationPlacementWarning)]
    ignored = "".join(str(w.message) for w in caught if issubclass(w.category, IgnoredKeysWarning))
    assert len(placement) == 1
    assert "num_replicas=2" in placement[0] and "inference.tensor_model_parallel_size" in placement[0]
    assert "max_model_len" not in placement[0] and "inference.name" not in placement[0]
    assert ("on its own pool" in placement[0]) is pool and ("on the trainer's own devices" in placement[0]) is not pool
    assert "distillation.nnodes" not in ignored                          # the pool's sizes act (pool) or are default


POOL = [f"{D}.nnodes=1", f"{D}.n_gpus_per_node=1"]


def test_a_teacher_pool_of_their_own_runs_over_ray_only_when_asked_for():
    from lathe.config import run_plan
    from lathe.loop.setup import uses_ray
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # nnodes / n_gpus_per_node act: no warning
        plan = run_plan(load_config("base", [*ONE, *POOL], device_count=1))
    assert plan.world == 1 and plan.teacher_devices == 1 and uses_ray(plan)      # one trainer device: Ray all the same
    two = run_plan(load(*TWO, f"{D}.nnodes=2", f"{D}.n_gpus_per_node=3"))
    assert two.teacher_devices == 6
    # verl's defaults (nnodes=0, n_gpus_per_node=8) move no teacher; a single size leaves them too
    for sizes in ([], [f"{D}.nnodes=0", f"{D}.n_gpus_per_node=8"], [f"{D}.n_gpus_per_node=2"]):
        plan = run_plan(load(*ONE, *sizes))
        assert plan.teacher_devices == 0 and not uses_ray(plan), sizes
    with pytest.warns(IgnoredKeysWarning, match="`distillation.nnodes`=1 has no effect"):
        load_config("base", POOL, device_count=1)                      # no distillation: nothing to place
    with pytest.warns(IgnoredKeysWarning, match="`distillation.n_gpus_per_node`=2 has no effect"):
        load_config("base", [*ONE, f"{D}.n_gpus_per_node=2"], device_count=1)   # no pool: its size is not read


ASYNC = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false"]


def test_a_teacher_pool_needs_devices_and_runs_in_both_loops():
    from lathe.config import run_plan
    with pytest.warns(IgnoredKeysWarning, match="`distillation.nnodes`=1 has no effect"):
        cfg = load_config("base", [*ONE, f"{D}.nnodes=1", f"{D}.n_gpus_per_node=0"], device_count=1)
    assert run_plan(cfg).teacher_devices == 0                          # no GPUs per node: no pool, said so
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # fully async: the pool's sizes act too (was refused)
        plan = run_plan(load_config("base", [*ONE, *POOL, *ASYNC], device_count=1))
    assert plan.is_async and (plan.world, plan.rollout_devices, plan.teacher_devices) == (1, 1, 1)


def test_a_teacher_pool_needs_its_gpus_visible_beside_the_trainers(monkeypatch):
    monkeypatch.setattr("lathe.config.rules.visible_cuda_devices", lambda: 2)
    cuda = [*ONE, *POOL, "trainer.device=cuda"]
    with pytest.raises(ConfigError) as err:                 # (device_count unset: the devices this process sees)
        load_config("base", [*cuda, "trainer.n_gpus_per_node=2"])
    text = str(err.value)
    assert f"trainer.n_gpus_per_node=2 + {D}.n_gpus_per_node=1 GPUs on this one node, but this process sees 2" in text
    assert "the trainer and the teachers each need devices of their own" in text
    load_config("base", cuda)                                                                 # 1 + 1 of 2
    load_config("base", [*cuda, "trainer.n_gpus_per_node=2", f"{D}.nnodes=2"])                # 2 nodes
    # fully async: trainer + rollout + the reward model's + the teachers' pools, all counted on the one node
    rm = ["reward_model.enable=true", "reward_model.model.path=/ckpt/rm", "reward_model.enable_resource_pool=true",
          "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"]
    monkeypatch.setattr("lathe.config.rules.visible_cuda_devices", lambda: 3)
    with pytest.raises(ConfigError) as err:
        load_config("base", [*cuda, *ASYNC, *rm])
    text = str(err.value)
    assert (f"trainer.n_gpus_per_node=1 + rollout.n_gpus_per_node=1 + reward_model.n_gpus_per_node=1 + "
            f"{D}.n_gpus_per_node=1 GPUs on this one node, but this process sees 3") in text
    assert "the trainer, the rollout, the reward model and the teachers each need devices of their own" in text
    assert f"trainer.nnodes/rollout.nnodes/reward_model.nnodes/{D}.nnodes" in text
    load_config("base", [*cuda, *ASYNC])                                                      # 1 + 1 + 1 of 3


def test_the_top_k_loss_as_a_reward_warns_as_verl_does():
    with pytest.warns(UserWarning, match="moves only the sampled token's log-prob"):
        load(*ONE, f"{D}.distillation_loss.loss_mode=forward_kl_topk", f"{D}.distillation_loss.use_policy_gradient=true")
