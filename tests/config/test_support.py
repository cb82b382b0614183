"""Tests for lathe.config.support: keys lathe does not act on yet fail (or warn) in load_config, defaults pass."""

import subprocess
import sys
import warnings

import pytest

from lathe.config import ConfigError, help_for, load_config, to_yaml
from lathe.config.schema import LatheConfig
from lathe.config.support import IgnoredKeysWarning, registry
from lathe.config.tree import all_paths, get_path

GRPO = ["algorithm.adv_estimator=grpo", "trainer.test_freq=-1"]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config("base", GRPO + list(overrides))
    return str(err.value)


@pytest.mark.parametrize(("override", "fix"), [
    ("reward_model.ulysses_sequence_parallel_size=2", "set it to 1"),
    ("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=2", "set it to 1"),
    ("reward_model.reward_manager=limited", "naive"),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size=2", "set it to 1"),
    ("data.sampler.class_path=my_sampler.py", "verl-schema parquet"),
    ("actor_rollout_ref.actor.tis_imp_ratio_cap=2.0", "rollout_is_threshold=2.0"),
    ("trainer.default_hdfs_dir=hdfs://ckpt", "set it back to null"),
])
def test_unimplemented_value_fails_naming_key_value_and_fix(override, fix):
    key, value = override.split("=", 1)
    text = refused(override)
    assert f"`{key}`=" in text and value.split(":")[0] in text
    assert "not implemented yet" in text and "Fix:" in text and fix in text


def test_all_refusals_are_reported_together_with_batch_problems():
    text = refused("reward_model.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.grad_offload=true",
                   "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=48")
    assert "3 config problems" in text and "ulysses_sequence_parallel_size" in text and "ppo_mini_batch_size=48" in text


def test_lora_is_accepted_on_several_devices_and_with_a_rollout_pool_and_for_the_critic():
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("base", GRPO + lora + ["trainer.n_gpus_per_node=2", "trainer.nnodes=2"])
    assert cfg.actor_rollout_ref.model.lora_rank == 8
    cfg = load_config("base", GRPO + lora + ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false"])
    assert cfg.actor_rollout_ref.model.lora_rank == 8        # fully async: the sync sends the merged adapted layers
    gae = ["algorithm.adv_estimator=gae", "critic.model.lora_rank=8", "critic.model.lora_alpha=32",
           "critic.model.target_modules=[q_proj,v_proj]"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("base", GRPO + gae + ["trainer.n_gpus_per_node=2"])
    assert cfg.critic.model.lora_rank == 8 and cfg.critic.model.target_modules == ["q_proj", "v_proj"]
    text = refused(*gae, "actor_rollout_ref.model.impl=hf")
    assert "critic.model.lora_rank=8 with actor_rollout_ref.model.impl=hf" in text and "Fix:" in text
    with pytest.warns(UserWarning, match="critic.model.lora_alpha"):        # read only with lora_rank > 0
        load_config("base", GRPO + ["algorithm.adv_estimator=gae", "critic.model.lora_alpha=32"])


ASYNC = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false"]


def test_a_reward_model_or_judge_runs_in_fully_async_mode_and_what_reads_its_scores_early_is_refused(tmp_path):
    rm = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}"]
    assert load_config("base", GRPO + ASYNC + rm).reward_model.enable      # scored on the trainer pool (_learn)
    load_config("base", GRPO + rm + ["algorithm.filter_groups.enable=true"])              # synchronous: scored first
    assert load_config("base", GRPO + ASYNC + rm + ["reward_model.judge.enable=true"]).reward_model.judge.enable
    for extra, keys, fix in (
            (["algorithm.filter_groups.enable=true"], ["`algorithm.filter_groups.enable`=true", "`reward_model.enable`"],
             "filter_groups.enable=false"),
            (["algorithm.adv_estimator=remax"], ["`algorithm.adv_estimator`=remax", "`reward_model.enable`"],
             "another estimator")):
        text = refused(*ASYNC, *rm, *extra)
        assert all(k in text for k in keys) and fix in text, text
        assert "rollout.n_gpus_per_node=0" in text and "remove reward_model.enable" in text


RM_POOL = ["reward_model.enable_resource_pool=true", "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1"]


def test_a_reward_model_pool_of_its_own_runs_over_ray_in_both_loops(tmp_path):
    from lathe.config import run_plan
    from lathe.loop.setup import uses_ray
    rm = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # nnodes / n_gpus_per_node act now: no warning
        cfg = load_config("base", GRPO + rm + RM_POOL)
        judge = load_config("base", GRPO + rm + RM_POOL + ["reward_model.judge.enable=true"])
        fully_async = load_config("base", GRPO + ASYNC + rm + RM_POOL)     # a third pool beside trainer and rollout
        async_judge = load_config("base", GRPO + ASYNC + rm + RM_POOL + ["reward_model.judge.enable=true"])
    plan = run_plan(cfg)
    assert plan.world == 1 and plan.reward_devices == 1 and uses_ray(plan)      # one trainer device: Ray all the same
    assert run_plan(judge).reward_devices == 1
    assert run_plan(load_config("base", GRPO + rm)).reward_devices == 0
    plan = run_plan(fully_async)
    assert (plan.world, plan.rollout_devices, plan.reward_devices) == (1, 1, 1) and plan.is_async
    assert run_plan(async_judge).reward_devices == 1
    # what reads the scores on the driver stays refused: the own pool too scores in the trainer thread
    text = refused(*ASYNC, *rm, *RM_POOL, "algorithm.filter_groups.enable=true")
    assert "`algorithm.filter_groups.enable`=true" in text and "(on the trainer pool, or its own pool)" in text
    with pytest.warns(IgnoredKeysWarning, match="reward_model.enable_resource_pool`=true has no effect"):
        load_config("base", GRPO + RM_POOL)                                   # no reward model: nothing to place
    with pytest.warns(IgnoredKeysWarning, match="reward_model.n_gpus_per_node`=2 has no effect"):
        load_config("base", GRPO + rm + ["reward_model.n_gpus_per_node=2"])   # no pool: its size is not read


@pytest.mark.parametrize("key", ["n_gpus_per_node", "nnodes"])
def test_a_reward_model_pool_needs_devices(tmp_path, key):
    rm = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}"]
    text = refused(*rm, *RM_POOL, f"reward_model.{key}=0")
    assert f"reward_model.{key}=0 with reward_model.enable_resource_pool=true" in text
    assert "must be >= 1" in text and f"Fix: set reward_model.{key} to 1 or more" in text


def test_a_reward_model_pool_needs_its_gpus_visible_beside_the_trainers(tmp_path, monkeypatch):
    rm = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}", "trainer.device=cuda"]
    monkeypatch.setattr("lathe.config.rules.visible_cuda_devices", lambda: 2)
    text = refused(*rm, *RM_POOL, "trainer.n_gpus_per_node=2")
    assert "trainer.n_gpus_per_node=2 + reward_model.n_gpus_per_node=1 GPUs on this one node, but this process " \
           "sees 2" in text and "trainer.nnodes/reward_model.nnodes" in text
    load_config("base", GRPO + rm + RM_POOL)                                  # 1 + 1 of 2
    load_config("base", GRPO + rm + RM_POOL + ["trainer.n_gpus_per_node=2", "reward_model.nnodes=2"])   # 2 nodes
    text = refused("trainer.device=cuda", "rollout.n_gpus_per_node=2", "actor_rollout_ref.hybrid_engine=false")
    assert "trainer.n_gpus_per_node=1 + rollout.n_gpus_per_node=2 GPUs on this one node" in text     # as before
    assert "the trainer and the rollout each need devices of their own" in text
    # fully async: trainer + rollout + the reward model's pool, all on one node
    text = refused(*rm, *RM_POOL, *ASYNC)
    assert "trainer.n_gpus_per_node=1 + rollout.n_gpus_per_node=1 + reward_model.n_gpus_per_node=1 GPUs on this one " \
           "node, but this process sees 2" in text
    assert "the trainer, the rollout and the reward model each need devices of their own" in text
    assert "trainer.nnodes/rollout.nnodes/reward_model.nnodes" in text
    load_config("base", GRPO + rm + RM_POOL + ASYNC + ["reward_model.nnodes=2"])     # its pool on 2 other nodes


def test_accepted_values_pass():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("base", GRPO + ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp",
                                    "reward_model.reward_manager=prime", "actor_rollout_ref.model.lora_rank=0",
                                    "actor_rollout_ref.rollout.mode=async", "reward_model.enable=false",
                                    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                                    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                                    "trainer.max_critic_ckpt_to_keep=2", "trainer.max_actor_ckpt_to_keep=2"])


@pytest.mark.parametrize("name", ["base", "default", "dapo", "gsm8k_grpo"])
def test_presets_and_their_printed_config_load_without_warnings(name, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(name)
        path = tmp_path / "printed.yaml"
        path.write_text(to_yaml(cfg))                   # what `lathe train --print-config` writes
        load_config(str(path))


def test_agent_loop_workers_warn_and_custom_agent_loops_are_checked(tmp_path):
    """Custom agent loops act (lathe.rollout.agent.custom); a missing file, a loop no file lists, and what they do
    not run with yet are refused naming the key."""
    a = "actor_rollout_ref.rollout.agent"
    with pytest.warns(IgnoredKeysWarning, match="agent-loop workers"):
        load_config("base", GRPO + [f"{a}.num_workers=4"])
    text = refused(f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}")
    assert "agent_loop_config_path" in text and "no such file" in text and "Fix:" in text
    text = refused(f"{a}.default_agent_loop=my_agent")
    assert "names a custom agent loop, but no" in text and "agent_loop_config_path" in text
    (tmp_path / "loops.yaml").write_text("- name: my_agent\n  _target_: pkg.MyAgent\n")
    path = f"{a}.agent_loop_config_path={tmp_path / 'loops.yaml'}"
    cfg = load_config("base", GRPO + [path, f"{a}.default_agent_loop=my_agent"])
    assert cfg.actor_rollout_ref.rollout.agent["default_agent_loop"] == "my_agent"
    tool = load_config("base", GRPO + [f"{a}.default_agent_loop=tool_agent"])       # verl's tool loop: lathe's
    assert tool.actor_rollout_ref.rollout.multi_turn.enable
    tp = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    assert load_config("base", GRPO + [path] + tp, device_count=2).actor_rollout_ref.rollout.agent    # a TP replica
    for extra, what in ((["actor_rollout_ref.actor.use_prefix_grouper=true"], "use_prefix_grouper"),
                        ([f"{a}.default_agent_loop=tool_agent"], "tool loop")):
        text = refused(path, *extra)
        assert what in text and "Fix:" in text


def test_keys_with_no_effect_warn_once_together():
    with pytest.warns(IgnoredKeysWarning) as record:
        load_config("base", GRPO + ["actor_rollout_ref.model.lora_alpha=32", "trainer.balance_batch=false",
                                    "actor_rollout_ref.nccl_timeout=1200"])
    assert len(record) == 1
    text = str(record[0].message)
    assert "3 config key(s)" in text and "lora_rank > 0" in text and "one device" in text


def test_every_default_passes_the_registry():
    cfg = LatheConfig()
    for entry in registry().values():
        assert entry.verdict(get_path(cfg, entry.key), get_path(cfg, entry.key), cfg) is None, entry.key


def test_help_says_what_the_registry_says():
    for key, entry in registry().items():
        text = help_for(key)
        assert {"refuse": "Not implemented yet in lathe", "warn": "No effect in lathe",
                "inert": "lathe behaves the same"}[entry.kind] in text, key
    assert not [p for p in all_paths() if "not used yet" in help_for(p)]


def test_refusal_happens_before_torch_is_imported():
    code = ("import sys; from lathe.config import load_config, ConfigError\n"
            "try:\n    load_config('base', ['reward_model.ulysses_sequence_parallel_size=2'])\n"
            "except ConfigError as e:\n    print('ulysses' in str(e), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_image_key_acts_and_video_key_is_refused_naming_the_fix():
    """Issue 17: `data.image_key` selects the images column of a vision-language run; videos are not implemented."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config("base", GRPO + ["data.image_key=pictures"])
    assert cfg.data.image_key == "pictures"
    assert "data.image_key" not in registry()
    text = refused("data.video_key=clips")
    assert "`data.video_key`=clips: video prompts" in text and "not implemented yet" in text
    assert "Fix:" in text and "image frames in the data.image_key column" in text
