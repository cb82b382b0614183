"""Tests for lathe.config.rules: cross-field batch rules, ranges, backend/run rules, device count."""

import warnings

import pytest

from lathe.config import ConfigError, batch_plan, load_config, resolve_devices
from lathe.config.rules import critic_in_use
from lathe.config.support import IgnoredKeysWarning

GRPO = ["algorithm.adv_estimator=grpo", "trainer.test_freq=-1"]


def fails(overrides, device_count=1, source="base"):
    """The ConfigError text for a config that must be rejected."""
    with pytest.raises(ConfigError) as err:
        load_config(source, GRPO + overrides, device_count=device_count)
    return str(err.value)


def batch(tbs, mini, n, micro=None):
    out = [f"data.train_batch_size={tbs}", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
           f"actor_rollout_ref.rollout.n={n}"]
    return out + ([f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"] if micro else [])


def test_good_batch_configs_pass():
    cfg = load_config("base", GRPO + batch(64, 16, 8, micro=4), device_count=4)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    load_config("base", GRPO + batch(64, 64, 1), device_count=2)


def test_rule1_positive_sizes():
    text = fails(batch(0, 1, 1))
    assert "data.train_batch_size=0" in text and ">= 1" in text
    assert "actor_rollout_ref.rollout.n=0" in fails(batch(8, 4, 0))


def test_rule2_mini_larger_than_step():
    text = fails(batch(32, 64, 4))
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=64" in text and "data.train_batch_size=32" in text


def test_rule2_mini_must_divide_step_example_message():
    text = fails(batch(64, 48, 8))
    assert "ppo_mini_batch_size=48 does not divide data.train_batch_size=64" in text
    assert "384 sequences" in text and "e.g. 32 or 64" in text


def test_rule3_mini_sequences_that_do_not_divide_over_devices_are_padded_with_ghost_rows():
    """A mini-batch that does not divide over the data-parallel ranks runs with ghost rows (lathe.cluster.dispatch)
    padding each rank's share, with one notice; beside a MoE router loss too (its statistics leave the ghost rows'
    tokens out: lathe.train.router_tokens), but not beside the prefix grouper, whose forward shares their prompts."""
    with pytest.warns(UserWarning, match=r"3 sequences per mini-batch do not divide over the 2 data-parallel ranks "
                                         r"\(device_count=2 given to load_config\): each rank gets 2, 1 of them ghost"):
        cfg = load_config("base", GRPO + batch(30, 3, 1), device_count=2)
    assert batch_plan(cfg, 2).mini_batch_sequences_per_device == 2
    router = ["actor_rollout_ref.actor.moe_aux_loss_coeff=0.01", "actor_rollout_ref.actor.moe_z_loss_coeff=0.001"]
    with pytest.warns(UserWarning, match="1 of them ghost"):
        load_config("base", GRPO + batch(30, 3, 1) + router, device_count=2)
    text = fails(batch(30, 3, 1) + router + ["actor_rollout_ref.actor.use_prefix_grouper=true"], device_count=2)
    assert "router statistics" in text and "moe_aux_loss_coeff=0.01" in text and "e.g. 2 or 6" in text
    assert "use_prefix_grouper=false" in text


def test_rule4_micro_divides_per_device_mini():
    text = fails(batch(64, 16, 5, micro=7), device_count=2)
    assert "ppo_micro_batch_size_per_gpu=7" in text and "40 sequences" in text
    with pytest.warns(UserWarning, match="ppo_micro_batch_size_per_gpu=80 is more than the per-device mini-batch of "
                                         "40 sequences"):          # verl's cut: the share as one micro-batch
        cfg = load_config("base", GRPO + batch(64, 16, 5, micro=80), device_count=2)
    assert batch_plan(cfg, 2).micro_batch_per_device == 40


def test_dynamic_bsz_skips_the_micro_rule_and_its_budgets_must_hold_the_longest_sequence():
    dyn = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=512", "data.max_response_length=512"]
    text = fails(batch(64, 16, 5, micro=7) + dyn + ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000"],
                 device_count=2)
    assert "ppo_micro_batch_size_per_gpu=7" not in text
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in text and "1024" in text
    # the log-prob budgets follow the actor's (verl's interpolation), so they are named too
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu" in text
    load_config("base", GRPO + batch(64, 16, 5, micro=7) + dyn, device_count=2)   # default budget 16384: fine


def test_rule6_critic_rules_apply_for_gae_only():
    overrides = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=24"] + batch(64, 16, 2)
    with pytest.raises(ConfigError, match=r"critic.ppo_mini_batch_size=24 does not divide"):
        load_config("base", overrides, device_count=1)
    load_config("base", GRPO + ["critic.ppo_mini_batch_size=24"] + batch(64, 16, 2), device_count=1)
    with pytest.raises(ConfigError, match=r"critic.ppo_micro_batch_size_per_gpu=3"):
        load_config("base", ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=3"] + batch(64, 16, 2))


def test_all_problems_listed_at_once():
    text = fails(batch(64, 48, 8) + ["actor_rollout_ref.rollout.top_p=1.5",
                                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert "3 config problems" in text


@pytest.mark.parametrize(
    ("override", "key"),
    [("actor_rollout_ref.actor.clip_ratio_high=-0.1", "clip_ratio_high"),
     ("actor_rollout_ref.actor.clip_ratio_c=1.0", "clip_ratio_c"),
     ("actor_rollout_ref.rollout.temperature=0", "rollout.temperature"),
     ("actor_rollout_ref.rollout.top_p=0", "rollout.top_p"),
     ("actor_rollout_ref.rollout.top_k=0", "rollout.top_k"),
     ("data.max_response_length=0", "data.max_response_length"),
     ("actor_rollout_ref.actor.optim.lr=-1e-6", "actor.optim.lr"),
     ("actor_rollout_ref.actor.ppo_epochs=0", "actor.ppo_epochs"),
     ("actor_rollout_ref.actor.optim.betas=[0.9]", "actor.optim.betas"),
     ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization")],
)
def test_rule7_ranges(override, key):
    text = fails([override])
    assert key in text and "out of range" in text


def test_val_temperature_zero_is_fine():
    cfg = load_config("base", GRPO + ["actor_rollout_ref.rollout.val_kwargs.temperature=0"])
    assert cfg.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0


def test_rule8_double_kl_warns_not_errors():
    with pytest.warns(UserWarning, match="use_kl_loss"):
        load_config("base", GRPO + ["actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("base", GRPO + ["actor_rollout_ref.actor.use_kl_loss=true"])


@pytest.mark.parametrize("name", ["vllm", "sglang", "trtllm"])
def test_rule9_verl_backends_are_accepted(name):
    """verl's backends run lathe's engine (tests/config/test_rollout_backends.py tests the notice)."""
    assert load_config("base", GRPO + [f"actor_rollout_ref.rollout.name={name}"]).actor_rollout_ref.rollout.name == name


@pytest.mark.parametrize("source", ["base", "default"])
def test_rule9_rollout_backend_defaults_to_auto_and_lathe_is_accepted(source):
    assert load_config(source, GRPO).actor_rollout_ref.rollout.name == "auto"
    cfg = load_config(source, GRPO + ["actor_rollout_ref.rollout.name=lathe", "actor_rollout_ref.model.impl=lathe"])
    assert cfg.actor_rollout_ref.rollout.name == "lathe"
    assert load_config("gsm8k_grpo").actor_rollout_ref.rollout.name == "lathe"


def test_rule9_lathe_engine_with_transformers_actor_fails_naming_both_keys():
    text = fails(["actor_rollout_ref.rollout.name=lathe", "actor_rollout_ref.model.impl=hf"])
    assert "actor_rollout_ref.rollout.name=lathe" in text and "actor_rollout_ref.model.impl=hf" in text
    assert "Fix:" in text and "impl=auto" in text
    for ok in (["actor_rollout_ref.rollout.name=auto"], ["actor_rollout_ref.rollout.name=hf"]):
        load_config("base", GRPO + ok + ["actor_rollout_ref.model.impl=hf"])


def test_rule9_rollout_dtype_and_max_model_len():
    assert "rollout.dtype=bf16 is not one of" in fails(["actor_rollout_ref.rollout.dtype=bf16"])
    lengths = ["data.max_prompt_length=100", "data.max_response_length=28"]
    assert load_config("base", GRPO + lengths).actor_rollout_ref.rollout.max_model_len == 128
    text = fails(lengths + ["actor_rollout_ref.rollout.max_model_len=127"])
    assert "max_model_len=127" in text and "128" in text
    load_config("base", GRPO + lengths + ["actor_rollout_ref.rollout.max_model_len=200"])


def test_rule10_resume_path_needs_path():
    assert "trainer.resume_from_path" in fails(["trainer.resume_mode=resume_path"])
    load_config("base", GRPO + ["trainer.resume_mode=resume_path", "trainer.resume_from_path=ck/step_5"])


def test_rule11_validation_needs_val_files():
    text = fails(["trainer.test_freq=5", "data.val_files=null"])
    assert "trainer.test_freq=5" in text and "data.val_files" in text
    load_config("base", ["algorithm.adv_estimator=grpo", "trainer.test_freq=5", "data.val_files=builtin:arithmetic"])


def test_device_count_resolution(monkeypatch):
    cfg = load_config("base", GRPO)
    assert resolve_devices(cfg).count == 1
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 2, 4
    monkeypatch.setattr("lathe.config.rules.cuda_available", lambda: True)
    assert resolve_devices(cfg).count == 8
    assert "trainer.n_gpus_per_node=4" in resolve_devices(cfg).why
    cfg.trainer.device = "cpu"                                   # CPU workers count as devices too
    assert resolve_devices(cfg).count == 8
    assert resolve_devices(cfg, 3).count == 3


def test_several_devices_are_planned_and_checked():
    cfg = load_config("base", GRPO + ["trainer.device=cpu", "trainer.n_gpus_per_node=2"] + batch(8, 4, 2))
    assert batch_plan(cfg).mini_batch_sequences_per_device == 4 * cfg.actor_rollout_ref.rollout.n // 2
    with pytest.warns(UserWarning, match=r"over the 3 data-parallel ranks \(3 = trainer.nnodes=3"):
        load_config("base", GRPO + ["trainer.device=cpu", "trainer.nnodes=3"] + batch(8, 4, 1), device_count=None)


def test_distribution_keys_act_on_several_devices_only():
    keys = ["actor_rollout_ref.nccl_timeout=60", "trainer.balance_batch=false"]
    with pytest.warns(UserWarning, match="nccl_timeout"):
        load_config("base", GRPO + keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        load_config("base", GRPO + keys + ["trainer.device=cpu", "trainer.n_gpus_per_node=2"] + batch(8, 4, 2))
    # fully async on one trainer device: the rollout pool's weight sync and the driver's waits read nccl_timeout,
    # and Ray places both pools
    with pytest.warns(UserWarning, match="balance_batch") as record:
        load_config("base", GRPO + keys + ["ray_kwargs.ray_init.num_cpus=8", "rollout.n_gpus_per_node=1",
                                           "actor_rollout_ref.hybrid_engine=false"])
    assert not any("nccl_timeout" in str(w.message) or "ray_kwargs" in str(w.message) for w in record)
    # optimizer_offload without param_offload on several devices: OffloadedAdamW (lathe.train.offloaded_adamw)
    load_config("base", GRPO + ["trainer.device=cpu", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor."
                                "fsdp_config.optimizer_offload=true"] + batch(8, 4, 2), device_count=None)


def test_planned_device_count_skips_the_device_rule():
    cfg = load_config("base", GRPO + ["trainer.n_gpus_per_node=8"] + batch(64, 16, 8), device_count=8)
    assert batch_plan(cfg, 8).mini_batch_sequences_per_device == 16


def test_gpus_asked_for_must_be_visible(monkeypatch):
    monkeypatch.setattr("lathe.config.rules.visible_cuda_devices", lambda: 0)
    text = fails(["trainer.device=cuda"], device_count=None)
    assert "trainer.device=cuda" in text and "sees 0" in text
    load_config("base", GRPO + ["trainer.device=auto"])        # auto: the CPU when no GPU is visible
    monkeypatch.setattr("lathe.config.rules.visible_cuda_devices", lambda: 1)
    load_config("base", GRPO + ["trainer.device=cuda"])


def test_visible_cuda_devices_without_torch(monkeypatch):
    from lathe.config import rules
    monkeypatch.setattr(rules, "_gpus_present", lambda: 4)
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert rules.visible_cuda_devices() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert rules.visible_cuda_devices() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert rules.visible_cuda_devices() == 4


def test_gen_batch_size_only_with_dynamic_sampling():
    text = fails(batch(64, 16, 2) + ["data.gen_batch_size=96"])
    assert "data.gen_batch_size=96" in text and "algorithm.filter_groups.enable=true" in text
    cfg = load_config("base", GRPO + batch(64, 16, 2) + ["data.gen_batch_size=96", "algorithm.filter_groups.enable=true"])
    assert cfg.data.gen_batch_size == 96
    assert load_config("base", GRPO + batch(64, 16, 2)).data.gen_batch_size == 64


def test_rollout_lengths_follow_data():
    text = fails(["actor_rollout_ref.rollout.response_length=64", "data.max_response_length=32"])
    assert "rollout.response_length=64" in text and "data.max_response_length=32" in text
    cfg = load_config("base", GRPO + ["actor_rollout_ref.rollout.prompt_length=100", "data.max_prompt_length=100"])
    assert cfg.actor_rollout_ref.rollout.prompt_length == 100


def test_batch_plan_numbers():
    cfg = load_config("base", GRPO + batch(64, 16, 8, micro=8), device_count=4)
    plan = batch_plan(cfg, 4)
    assert (plan.sequences_per_step, plan.mini_batch_sequences, plan.mini_batches_per_step) == (512, 128, 4)
    assert (plan.mini_batch_sequences_per_device, plan.micro_batch_per_device, plan.grad_accum_steps) == (32, 8, 4)
    cfg = load_config("base", GRPO + batch(64, 16, 8), device_count=4)
    assert batch_plan(cfg, 4).micro_batch_per_device == 32  # null micro = whole per-device mini-batch


def test_critic_in_use():
    assert critic_in_use(load_config("base", ["trainer.test_freq=-1"]))
    assert not critic_in_use(load_config("base", GRPO))
    assert critic_in_use(load_config("base", GRPO + ["critic.enable=true"]))
