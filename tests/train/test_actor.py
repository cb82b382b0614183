"""Tests for lathe.train.actor.PPOActor: micro-batch invariance, the KL loss, PPO epochs, metrics."""

import pytest
import torch

from lathe.config import batch_plan

from lathe.train.actor import PPOActor, policy_loss_params
from lathe.train.logprob import response_log_probs
from lathe.train.optim import build_optimizer, build_scheduler
from lathe.train.update import EpochShuffle, NonFiniteGuard, NonFiniteUpdates

from helpers import assert_close_rel

from .conftest import UPDATE_REL


def _actor(model, cfg, optimizer=None):
    arr = cfg.actor_rollout_ref
    optimizer = optimizer or build_optimizer(model.parameters(), arr.actor.optim)
    scheduler = build_scheduler(optimizer, arr.actor.optim, total_steps=10)
    return PPOActor(model, optimizer, scheduler, arr.actor,
                    mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                    temperature=arr.rollout.temperature,
                    max_response_length=cfg.data.max_response_length)


def _ppo_batch(model, rollout_batch, temperature, seed=0, adv_scale=1.0):
    """A rollout batch plus `old_log_probs` (current policy, perturbed so ratios != 1), advantages, ref."""
    batch = rollout_batch(rows=8, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch["response_mask"].float()
    with torch.no_grad():
        logp, _ = response_log_probs(model.eval(), batch, temperature=temperature)
    model.train()
    shape = mask.shape
    batch["old_log_probs"] = (logp + 0.3 * torch.randn(shape, generator=g)) * mask
    batch["advantages"] = adv_scale * torch.randn(shape[0], 1, generator=g).expand(shape) * mask
    batch["ref_log_prob"] = (logp + 0.5 * torch.randn(shape, generator=g)) * mask
    return batch


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _update(params, start):
    """What an update changed, by parameter name: compared by norm-relative error (see helpers)."""
    return {k: params[k] - start[k] for k in start}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(make_model, rollout_batch, load_cfg, agg):
    common = [f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.use_kl_loss=true",
              "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.grad_clip=1000.0",
              "data.max_prompt_length=5", "data.max_response_length=6"]     # the test batch's longest: 11 tokens
    start = _params(make_model())
    results = {}
    # mini-batch = 2 prompts x n=2 = 4 sequences: whole, halves, quarters, and packed by a 12-token budget
    for micro in ("null", 4, 2, 1, "dynamic"):
        by = (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12"]
              if micro == "dynamic" else [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"])
        cfg = load_cfg(*common, *by)
        model = make_model()
        # SGD: the update is the gradient, scale included; Adam's first step is ~lr * sign(gradient), which
        # hides a mis-scaled gradient and turns the rounding noise of a near-zero one into a full lr step
        actor = _actor(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        metrics = actor.update_policy(_ppo_batch(model, rollout_batch, temperature=0.7))
        results[micro] = (_params(model), metrics)
    whole, whole_metrics = results["null"]
    assert _max_diff(whole, start) > 1e-4, "precondition: the update moves the parameters"
    for micro in (4, 2, 1, "dynamic"):
        params, metrics = results[micro]
        assert_close_rel(_update(params, start), _update(whole, start), UPDATE_REL,
                         name=f"update with micro-batch {micro}")
        # losses are normalised by whole-mini-batch counts, so they add up exactly over micro-batches
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-7), key


def _kl_to_ref(model, batch, temperature):
    with torch.no_grad():
        logp, _ = response_log_probs(model, batch, temperature=temperature)
    diff = (logp - batch["ref_log_prob"]) * batch["response_mask"]
    return float(diff.abs().sum())


@pytest.mark.parametrize("use_kl", [True, False])
def test_kl_loss_gradient_moves_policy_towards_reference(make_model, rollout_batch, load_cfg, use_kl):
    cfg = load_cfg(f"actor_rollout_ref.actor.use_kl_loss={str(use_kl).lower()}",
                   "actor_rollout_ref.actor.kl_loss_coef=1.0", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                   "actor_rollout_ref.actor.entropy_coeff=0.0")
    model = make_model()
    batch = _ppo_batch(model, rollout_batch, temperature=1.0, adv_scale=0.0)   # no policy-gradient signal
    before, kl_before = _params(model), _kl_to_ref(model, batch, 1.0)
    actor = _actor(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    metrics = actor.update_policy(batch)
    if use_kl:
        assert metrics["actor/kl_loss"] > 0 and metrics["actor/kl_coef"] == 1.0
        assert metrics["actor/grad_norm"] > 0
        assert _kl_to_ref(model, batch, 1.0) < kl_before
    else:
        assert "actor/kl_loss" not in metrics
        assert metrics["actor/grad_norm"] == 0.0
        assert _max_diff(_params(model), before) == 0.0


def test_ppo_epochs_two_optimizer_steps_per_mini_batch(make_model, rollout_batch, load_cfg):
    for epochs, expected_steps in ((1, 2), (2, 4)):
        cfg = load_cfg(f"actor_rollout_ref.actor.ppo_epochs={epochs}")
        model = make_model()
        actor = _actor(model, cfg)
        calls = []
        actor.optimizer.register_step_post_hook(lambda *_: calls.append(1))
        metrics = actor.update_policy(_ppo_batch(model, rollout_batch, temperature=1.0))
        assert len(calls) == expected_steps          # 8 sequences / mini-batches of 4, times ppo_epochs
        assert actor.scheduler.last_epoch == 1       # the schedule advances once per RL step
        assert {"actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl"} <= set(metrics)


def test_shuffle_runs_each_epoch_over_its_own_order_of_the_rows(make_model, rollout_batch, load_cfg):
    """actor.shuffle=true: the update equals unshuffled one-epoch updates over each epoch's order (`EpochShuffle`,
    drawn from data_loader_seed and the update count), and differs from the unshuffled update."""
    steady = ["actor_rollout_ref.actor.optim.lr_warmup_steps=0",       # two updates by hand at one learning rate
              "actor_rollout_ref.actor.optim.lr_scheduler_type=constant"]
    common = ["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.data_loader_seed=11", *steady]
    model = make_model()
    start, state = _params(model), {k: v.clone() for k, v in model.state_dict().items()}
    batch = _ppo_batch(model, rollout_batch, temperature=1.0)
    shuffled = _actor(model, load_cfg(*common, "actor_rollout_ref.actor.shuffle=true"))
    shuffled.update_policy(batch)
    orders = [EpochShuffle(11, 0).order(batch, epoch) for epoch in range(2)]
    assert orders[0] != list(range(8)) and orders[0] != orders[1]
    by_hand = make_model()
    by_hand.load_state_dict(state)
    epochwise = _actor(by_hand, load_cfg("actor_rollout_ref.actor.ppo_epochs=1", *steady))
    for order in orders:
        epochwise.update_policy(batch.select(order))
    assert_close_rel(_update(_params(model), start), _update(_params(by_hand), start), UPDATE_REL)
    plain = make_model()
    plain.load_state_dict(state)
    _actor(plain, load_cfg(*common)).update_policy(batch)
    assert _max_diff(_params(plain), _params(model)) > 0


def test_non_finite_gradient_skips_the_step(make_model, rollout_batch, load_cfg):
    model = make_model()
    actor = _actor(model, load_cfg())
    batch = _ppo_batch(model, rollout_batch, temperature=1.0)
    batch["advantages"][0, 0] = float("nan")
    before = _params(model)
    metrics = actor.update_policy(batch)
    assert metrics["actor/grad_norm"] != metrics["actor/grad_norm"]  # nan
    # the first mini-batch (rows 0-3) was skipped, so no NaN reached the weights; the second one still trained
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _max_diff(_params(model), before) > 0
    assert metrics["actor/skipped_updates"] == 0.5        # one of the step's two mini-batch updates


def test_non_finite_updates_in_a_row_stop_with_the_batch_saved(make_model, rollout_batch, load_cfg, tmp_path):
    model = make_model()
    cfg = load_cfg()
    arr = cfg.actor_rollout_ref
    optimizer = build_optimizer(model.parameters(), arr.actor.optim)
    actor = PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                     mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                     temperature=1.0, max_response_length=cfg.data.max_response_length,
                     nonfinite=NonFiniteGuard("actor", limit=3, dump_dir=tmp_path))
    batch = _ppo_batch(model, rollout_batch, temperature=1.0)
    batch["advantages"][:, 0] = float("inf")                 # every mini-batch: 2 skipped updates per step
    assert actor.update_policy(batch)["actor/skipped_updates"] == 1.0
    with pytest.raises(NonFiniteUpdates, match="3 updates in a row had a non-finite gradient norm") as err:
        actor.update_policy(batch)
    assert "actor_skip3.pt" in str(err.value) and (tmp_path / "actor_skip3.pt").exists()
    assert torch.isinf(torch.load(tmp_path / "actor_skip1.pt", weights_only=True)["advantages"]).any()


def test_policy_loss_params_from_actor_config(load_cfg):
    cfg = load_cfg("actor_rollout_ref.actor.clip_ratio_low=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.28",
                   "actor_rollout_ref.actor.clip_ratio_c=4.0")
    params = policy_loss_params(cfg.actor_rollout_ref.actor)
    assert (params.low, params.high, params.clip_ratio_c) == (0.1, 0.28, 4.0)


def _actor_remove_padding(model, cfg, remove_padding):
    """SGD, so that parameter differences are the gradient differences (Adam would magnify tiny ones)."""
    arr = cfg.actor_rollout_ref
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                    mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                    temperature=arr.rollout.temperature,
                    max_response_length=cfg.data.max_response_length, use_remove_padding=remove_padding)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_lathe_packed_and_padded_updates_agree(make_model, make_lathe, rollout_batch, load_cfg, agg):
    """PPO updates of lathe's decoder: packed (use_remove_padding) = padded, and both equal to the same update
    of the transformers model they were converted from (norm-relative UPDATE_REL in fp32)."""
    cfg = load_cfg(f"actor_rollout_ref.actor.loss_agg_mode={agg}", "actor_rollout_ref.actor.use_kl_loss=true",
                   "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.temperature=0.7",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_epochs=2",
                   "actor_rollout_ref.actor.grad_clip=1000.0")
    batch = _ppo_batch(make_model(), rollout_batch, temperature=0.7)
    start = _params(make_model())
    results = {}
    for name, model, packed in (("hf", make_model(), False), ("padded", make_lathe(), False),
                                ("packed", make_lathe(), True)):
        metrics = _actor_remove_padding(model, cfg, packed).update_policy(batch)
        results[name] = (_params(model), metrics)
    assert _max_diff(results["padded"][0], start) > 1e-3, "precondition: the update moves the parameters"
    packed, padded, hf = (_update(results[name][0], start) for name in ("packed", "padded", "hf"))
    assert_close_rel(packed, padded, UPDATE_REL, name="packed update")
    assert_close_rel(padded, hf, UPDATE_REL, name="lathe update vs transformers'")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert results["packed"][1][key] == pytest.approx(results["padded"][1][key], rel=1e-5, abs=1e-6), key
        assert results["padded"][1][key] == pytest.approx(results["hf"][1][key], rel=1e-4, abs=1e-5), key


def test_loss_scale_factor_divides_seq_mean_token_sum_norm(make_model, rollout_batch, load_cfg):
    """actor.loss_scale_factor replaces the default divisor (data.max_response_length) of seq-mean-token-sum-norm."""
    losses = {}
    for factor in ("null", 2 * 16):
        cfg = load_cfg("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "data.max_response_length=16",
                       f"actor_rollout_ref.actor.loss_scale_factor={factor}", "actor_rollout_ref.actor.optim.lr=0")
        model = make_model()
        losses[factor] = _actor(model, cfg).update_policy(_ppo_batch(model, rollout_batch, temperature=1.0))
    assert losses[32]["actor/pg_loss"] == pytest.approx(losses["null"]["actor/pg_loss"] / 2, rel=1e-5)


ON_POLICY = ("actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.actor.entropy_coeff=0.01")      # one mini-batch of 8 in micro-batches of 2


def _on_policy_batch(model, rollout_batch, low, high):
    """A PPO batch whose engine log-probs are the policy's shifted by U(low, high) per token, and the policy's own
    log-probs (pi_old of an on-policy update)."""
    batch = _ppo_batch(model, rollout_batch, temperature=1.0)
    g = torch.Generator().manual_seed(7)
    shift = low + (high - low) * torch.rand(batch["old_log_probs"].shape, generator=g)
    batch["rollout_log_probs"] = batch["old_log_probs"] + shift
    with torch.no_grad():
        own, _ = response_log_probs(model.train(), batch, temperature=1.0)
    return batch, own


def test_on_policy_update_takes_old_log_probs_from_its_own_forward(make_model, rollout_batch, load_cfg):
    """Without `old_log_probs` (the loop saved the old-policy forward: one epoch, one mini-batch), the update equals
    one given the policy's own log-probs, and reports the engine-vs-trainer diff of the whole batch."""
    from lathe.algo import rollout_probs_diff
    cfg = load_cfg(*ON_POLICY)
    start = _params(make_model())
    results = {}
    for given in (True, False):
        model = make_model()
        batch, own = _on_policy_batch(model, rollout_batch, -0.1, 0.0)
        if given:
            batch["old_log_probs"] = own
        else:
            del batch.tensors["old_log_probs"]
        actor = _actor(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        metrics = actor.update_policy(batch)
        results[given] = (_params(model), metrics, own, batch)
    (with_old, m_with, own, batch), (without, m_without, _, _) = results[True], results[False]
    assert _max_diff(with_old, start) > 1e-4
    assert_close_rel(_update(without, start), _update(with_old, start), UPDATE_REL, name="on-policy update")
    assert m_without["actor/pg_loss"] == pytest.approx(m_with["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert m_without["actor/pg_clipfrac"] == 0.0
    expected = rollout_probs_diff(own, batch["rollout_log_probs"], batch["response_mask"])
    for k, v in expected.items():
        assert m_without[f"training/rollout_probs_diff_{k}"] == pytest.approx(v, rel=1e-4, abs=1e-7), k
    assert not any(k.startswith("training/") for k in m_with)      # the loop reports it when it ran the forward


@pytest.mark.parametrize("correction", [dict(rollout_is="token", rollout_is_threshold=1.05),
                                        dict(rollout_is="sequence", rollout_is_threshold="0.8_1.3")],
                         ids=["token-tis", "sequence-icepop"])
def test_on_policy_update_corrects_against_its_own_forward(make_model, rollout_batch, load_cfg, correction):
    """Rollout correction's IS weights computed inside an on-policy update from its own forward (the loop saved the
    old-policy forward: `in_update`) equal the loop's path: the weights computed from a separate forward's
    log-probs before the update, the same update and the same `rollout_corr/*` metrics of the whole batch."""
    from lathe.algo.rollout_correction import ROLLOUT_CORRECTION_KEYS, compute_rollout_correction
    cfg = load_cfg(*ON_POLICY)
    rc = {**ROLLOUT_CORRECTION_KEYS, **correction}
    start = _params(make_model())
    results = {}
    for given in (True, False):
        model = make_model()
        batch, own = _on_policy_batch(model, rollout_batch, -0.1, 0.1)
        expected = None
        if given:                                   # the loop's path: pi_old's forward, then the correction
            batch["old_log_probs"] = own
            weights, _, expected = compute_rollout_correction(own, batch["rollout_log_probs"], batch["response_mask"],
                                                              **rc)
            batch["rollout_is_weights"] = weights
        else:
            del batch.tensors["old_log_probs"]
        actor = PPOActor(model, torch.optim.SGD(model.parameters(), lr=0.1), None, cfg.actor_rollout_ref.actor,
                         mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device, temperature=1.0,
                         max_response_length=cfg.data.max_response_length, rollout_correction=rc)
        actor.scheduler = build_scheduler(actor.optimizer, cfg.actor_rollout_ref.actor.optim, total_steps=10)
        metrics = actor.update_policy(batch)
        results[given] = (_params(model), metrics, expected)
    (with_old, m_with, expected), (without, m_without, _) = results[True], results[False]
    outside = sum(float(expected[f"rollout_corr/rollout_is_ratio_fraction_{side}"]) for side in ("high", "low"))
    assert 0 < outside < 1, "precondition: the bounds cut some ratios, not all"
    assert _max_diff(with_old, start) > 1e-4
    assert_close_rel(_update(without, start), _update(with_old, start), UPDATE_REL, name="corrected on-policy update")
    assert m_without["actor/pg_loss"] == pytest.approx(m_with["actor/pg_loss"], rel=1e-5, abs=1e-7)
    for k, v in expected.items():
        assert m_without[k] == pytest.approx(float(v), rel=1e-4, abs=1e-6), k
    assert not any(k.startswith("rollout_corr/") for k in m_with)     # the loop reports it when it ran the forward


def test_update_without_old_log_probs_must_be_on_policy(make_model, rollout_batch, load_cfg):
    model = make_model()
    batch = _ppo_batch(model, rollout_batch, temperature=1.0)
    del batch.tensors["old_log_probs"]
    for overrides in (["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
                      []):                                             # 2 epochs; 2 mini-batches
        with pytest.raises(ValueError, match="no old_log_probs"):
            _actor(model, load_cfg(*overrides)).update_policy(batch)


@pytest.mark.parametrize("params", [dict(loss_mode="k3", use_task_rewards=True, distillation_loss_coef=0.5),
                                    dict(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False,
                                         loss_max_clamp=1.0),
                                    dict(loss_mode="forward_kl_topk", topk=4, use_task_rewards=False,
                                         log_prob_min_clamp=-5.0)], ids=["k3-with-task", "k1-pg-alone", "topk"])
def test_distillation_update_does_not_depend_on_micro_batch_size(make_model, rollout_batch, load_cfg, params):
    from lathe.algo.distillation import DistillationParams
    start = _params(make_model())
    results = {}
    for micro in ("null", 1):
        cfg = load_cfg(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.grad_clip=1000.0")
        model = make_model()
        arr = cfg.actor_rollout_ref
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        actor = PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                         mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device, temperature=1.0,
                         max_response_length=cfg.data.max_response_length, distillation=DistillationParams(**params))
        batch = _ppo_batch(model, rollout_batch, temperature=1.0)
        batch["teacher_log_probs"] = (batch["ref_log_prob"] - 0.7) * batch["response_mask"]
        g = torch.Generator().manual_seed(9)
        top = torch.log_softmax(torch.randn(*batch["response_mask"].shape, 40, generator=g) * 3, -1).topk(4, dim=-1)
        batch["teacher_topk_log_probs"], batch["teacher_topk_ids"] = top.values, top.indices
        metrics = actor.update_policy(batch)
        results[micro] = (_params(model), metrics)
    (whole, whole_metrics), (params_1, metrics_1) = results["null"], results[1]
    assert _max_diff(whole, start) > 1e-4
    assert_close_rel(_update(params_1, start), _update(whole, start), UPDATE_REL, name="distillation update")
    extremes = [k for k in whole_metrics if k.startswith("distillation/") and k.endswith(("_min", "_max"))]
    keys = ("distillation/loss", "actor/grad_norm", *extremes)     # as one vector: float32 rounding of each
    assert_close_rel([metrics_1[k] for k in keys], [whole_metrics[k] for k in keys], rel=1e-5, name="metrics")
    assert whole_metrics["distillation/loss_min"] < whole_metrics["distillation/loss_max"]
