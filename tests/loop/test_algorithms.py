"""Every advantage estimator, policy loss and correction mode runs from the command line on the built-in task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lathe.algo import ADV_ESTIMATORS, POLICY_LOSSES
from lathe.cli import main

from helpers import warm_started

FAST = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=4", "trainer.total_training_steps=2",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]",
        "critic.ppo_mini_batch_size=2"]


def train(tmp_path, *overrides: str, source: str | None = None, warm: int = 30) -> dict[int, dict]:
    """FAST on the built-in model warm-started for `warm` steps (built once per session: tests/helpers.py)."""
    run_dir = tmp_path / "run"
    args = ["train"] + ([source] if source else []) + FAST + list(warm_started(warm)) + [
        f"trainer.default_local_dir={run_dir}", *overrides]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


TWO_REWARDS = Path(__file__).with_name("two_rewards.py")
# the keys an estimator or loss cannot run without (config rules refuse it otherwise)
NEEDS = {
    "gdpo": [f"reward.custom_reward_function.path={TWO_REWARDS}",
             "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]", "algorithm.gdpo_reward_weights=[1.0,0.5]"],
    "optimal_token_baseline": ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
    "tir_optimal_token_baseline": ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
    "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
}


@pytest.mark.parametrize("estimator", sorted(n for n in ADV_ESTIMATORS))
def test_each_advantage_estimator_runs(tmp_path, estimator):
    metrics = train(tmp_path, f"algorithm.adv_estimator={estimator}", *NEEDS.get(estimator, []))
    assert sorted(metrics) == [1, 2]
    assert "actor/pg_loss" in metrics[2] and "critic/advantages/mean" in metrics[2]
    if estimator == "gae":
        assert "critic/vf_loss" in metrics[2] and "critic/values/mean" in metrics[2]
    if estimator == "remax":
        assert "timing_s/gen_max" in metrics[2]
    if estimator.endswith("optimal_token_baseline"):                    # verl's metrics of sum_pi_squared
        assert metrics[2]["variance_proxy/expected_w"] > 0
    if estimator == "gdpo":
        assert "reward_extra/format_reward/mean" in metrics[2]


@pytest.mark.parametrize("loss_mode", sorted(n for n in POLICY_LOSSES if n != "bypass_mode"))
def test_each_policy_loss_runs(tmp_path, loss_mode):
    metrics = train(tmp_path, f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *NEEDS.get(loss_mode, []))
    assert "actor/pg_clipfrac" in metrics[2]


@pytest.mark.parametrize("kl", ["kl", "abs", "mse", "low_var_kl", "k3+"])
def test_kl_in_loss_and_in_reward(tmp_path, kl):
    metrics = train(tmp_path, "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_type={kl}",
                    "algorithm.use_kl_in_reward=true", f"algorithm.kl_penalty={kl.rstrip('+')}",
                    "algorithm.kl_ctrl.type=adaptive")
    assert "actor/kl_loss" in metrics[2] and "actor/reward_kl_penalty_coeff" in metrics[2]


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
def test_each_loss_aggregation_runs(tmp_path, agg):
    metrics = train(tmp_path, f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    assert metrics[2]["actor/grad_norm"] >= 0


@pytest.mark.parametrize("overrides", [
    ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"],
    ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0"],
    ["algorithm.rollout_correction.rollout_rs=seq_mean_k1", "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
    ["algorithm.rollout_correction.bypass_mode=true"],
    ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
     "algorithm.rollout_correction.rollout_is=token"],
], ids=["tis-token", "icepop-seq", "geo-rs", "bypass-ppo", "bypass-reinforce"])
def test_rollout_correction_modes(tmp_path, overrides):
    metrics = train(tmp_path, *overrides)
    assert any(k.startswith("rollout_corr/") for k in metrics[2]), sorted(metrics[2])
    bypass = "algorithm.rollout_correction.bypass_mode=true" in overrides      # pi_old := the engine's log-probs
    assert metrics[2]["training/old_log_prob_from_rollout"] == float(bypass)
    assert metrics[2]["training/old_log_prob_forward"] == float(not bypass)


def test_dapo_preset_filters_groups_and_shapes_overlong(tmp_path):
    metrics = train(tmp_path, source="dapo", warm=60)
    assert metrics[2]["train/num_gen_batches"] >= 1
    assert "reward_extra/overlong_reward/mean" in metrics[2]


def test_dynamic_sampling_gives_up_with_a_clear_error(tmp_path, capsys):
    # no warm start: every sample scores 0, so no group ever has variance
    rc = main(["train", *FAST, f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.warm_start.steps=0",
               "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"])
    assert rc == 2
    assert "max_num_gen_batches" in capsys.readouterr().err


@pytest.mark.parametrize("lora", [False, True])
def test_prefix_grouper_equals_the_per_row_run(tmp_path, monkeypatch, lora):
    """Two PPO epochs with the KL loss: the old-log-prob pass, the reference's and the update run prefix-grouped;
    the run's losses and gradient norms equal the per-row run's (tests/train/test_prefix_group.py: each pass's
    numbers). `lora`: the adapters train, and the reference is the same model with them off."""
    import lathe.train.logprob as logprob
    grouped_hidden, models = logprob.grouped_hidden, set()

    def seen(model, batch):
        models.add((id(model), torch.is_grad_enabled()))
        return grouped_hidden(model, batch)
    monkeypatch.setattr(logprob, "grouped_hidden", seen)
    runs = [train(tmp_path / str(grouped), "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_epochs=2",
                  "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
                  f"actor_rollout_ref.actor.use_prefix_grouper={str(grouped).lower()}",
                  *(["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"] if lora else []))
            for grouped in (True, False)]
    assert runs[0][2]["actor/grad_norm"] > 0 and "timing_s/old_log_prob" in runs[0][2]
    assert runs[0][2]["actor/kl_loss"] > 0                      # the second step's update has moved off the reference
    forward_only = {m for m, grad in models if not grad}        # actor and reference (LoRA: one model, adapters off)
    assert len(forward_only) == (1 if lora else 2) and any(grad for _, grad in models)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        for step in (1, 2):
            assert runs[0][step][key] == pytest.approx(runs[1][step][key], rel=1e-4, abs=1e-7), (key, step)
