"""Tests for lathe.config.rules_parallel and the plan's sequence-parallel facts: sizes that divide the devices, packed
forwards, mini-batches split over data-parallel groups, token budgets per group."""

import pytest

from lathe.config import ConfigError, load_config, run_plan

A, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
GRPO = ["algorithm.adv_estimator=grpo", "trainer.test_freq=-1", *PACKED]
GAE = ["algorithm.adv_estimator=gae", "trainer.test_freq=-1", *PACKED]


def load(*overrides: str, devices: int = 4):
    return load_config("base", [f"trainer.n_gpus_per_node={devices}", *overrides])


def fails(*overrides: str, devices: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        load(*overrides, devices=devices)
    return str(err.value)


def test_a_size_that_does_not_divide_the_devices_is_refused_by_key():
    text = fails(*GRPO, f"{A}.ulysses_sequence_parallel_size=3")
    assert f"{A}.ulysses_sequence_parallel_size=3 does not divide the device count (4 = trainer.nnodes=1 x " \
           "trainer.n_gpus_per_node=4)" in text and "(1, 2, 4)" in text
    assert f"{REF}.ulysses_sequence_parallel_size=3 does not divide" in text     # the reference takes the actor's
    assert "critic.ulysses_sequence_parallel_size=2 does not divide the device count (1 = " in \
        fails(*GAE, "critic.ulysses_sequence_parallel_size=2", devices=1)
    assert f"{A}.ulysses_sequence_parallel_size=0 must be >= 1" in fails(*GRPO, f"{A}.ulysses_sequence_parallel_size=0")


def test_sequence_parallel_needs_the_packed_forward_and_no_prefix_grouper():
    text = fails("algorithm.adv_estimator=grpo", "trainer.test_freq=-1", f"{A}.ulysses_sequence_parallel_size=2")
    assert (f"{A}.ulysses_sequence_parallel_size=2 splits the packed stream of each micro-batch over 2 devices, but "
            "actor_rollout_ref.model.use_remove_padding=false runs it padded") in text
    text = fails(*GAE, "critic.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=false")
    assert "Fix: set critic.model.use_remove_padding=true (or critic.ulysses_sequence_parallel_size=1)" in text
    text = fails(*GRPO, f"{A}.ulysses_sequence_parallel_size=2", f"{A}.use_prefix_grouper=true")
    assert f"{A}.use_prefix_grouper=true with {A}.ulysses_sequence_parallel_size=2" in text


def test_the_plan_splits_mini_batches_over_data_parallel_groups():
    """4 devices in 2 groups of 2: a mini-batch of 2 prompts x n=1 splits over the 2 groups (not over 4 devices)."""
    sizes = ["data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=1",
             "critic.ppo_mini_batch_size=2"]
    with pytest.warns(UserWarning, match="ghost rows"):           # 2 sequences over 4 ranks: padded
        load(*GAE, *sizes)
    cfg = load(*GAE, *sizes, f"{A}.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=4")
    plan = run_plan(cfg)
    assert (plan.actor.device_count, plan.actor.sequence_parallel_size, plan.actor.data_parallel_size) == (4, 2, 2)
    assert plan.actor.mini_batch_sequences_per_device == 1 and plan.critic.mini_batch_sequences_per_device == 2
    assert plan.ref_sequence_parallel_size == 2 and plan.critic.data_parallel_size == 1
    assert run_plan(load(*GRPO, f"{A}.ulysses_sequence_parallel_size=2",
                         f"{REF}.ulysses_sequence_parallel_size=4")).ref_sequence_parallel_size == 4
    with pytest.warns(UserWarning, match=r"the per-device mini-batch of 1 sequences \(ppo_mini_batch_size=2 x "
                                         r"rollout.n=1 / 2 data-parallel group\(s\) of 2 devices\)"):
        load(*GRPO, "data.train_batch_size=4", f"{A}.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=1",
             f"{A}.ppo_micro_batch_size_per_gpu=2", f"{A}.ulysses_sequence_parallel_size=2")


def test_token_budgets_count_per_device_times_the_size():
    """verl's rule: a sequence-parallel group's micro-batch holds the per-device budget x the size."""
    longest = ["data.max_prompt_length=1024", "data.max_response_length=1024", f"{A}.use_dynamic_bsz=true"]
    budgets = [f"{A}.ppo_max_token_len_per_gpu=1024", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
               f"{REF}.log_prob_max_token_len_per_gpu=512"]
    text = fails(*GRPO, *longest, *budgets, f"{A}.ulysses_sequence_parallel_size=2")
    assert f"{A}.ppo_max_token_len_per_gpu" not in text and "rollout.log_prob_max_token_len_per_gpu" not in text
    assert (f"{REF}.log_prob_max_token_len_per_gpu=512 is out of range: it times {REF}.ulysses_sequence_parallel_size"
            "=2 must be >= data.max_prompt_length + data.max_response_length = 2048") in text
    load(*GRPO, *longest, *budgets, f"{A}.ulysses_sequence_parallel_size=2", f"{REF}.ulysses_sequence_parallel_size=4")
    assert "ppo_max_token_len_per_gpu=1024 is out of range" in fails(*GRPO, *longest, *budgets)


def test_the_reward_model_still_refuses_it():
    text = fails(*GRPO, "reward_model.ulysses_sequence_parallel_size=2")
    assert "Ulysses sequence parallelism for the reward model" in text
