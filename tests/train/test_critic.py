"""Tests for lathe.train.critic: value alignment, micro-batch invariance, fitting, value clipping, checkpoints."""

import pytest
import torch

from lathe.config import batch_plan
from lathe.data.builtin import builtin_tokenizer
from lathe.train.critic import PPOCritic, response_values
from lathe.workers.critic import CriticWorker

from helpers import assert_close_rel

from .conftest import UPDATE_REL

VOCAB, PAD = 40, 0   # the vocabulary of conftest.rollout_batch
# mini-batch = critic.ppo_mini_batch_size 2 prompts x rollout.n 2 = 4 sequences; 8 rows -> 2 mini-batches
CRITIC = ["critic.ppo_mini_batch_size=2", "critic.optim.lr=1e-3", "critic.grad_clip=1000.0"]


def _value_model(seed: int = 0):
    """A tiny Qwen2 value model with a random (non-zero) head, so every parameter gets a gradient."""
    from transformers import Qwen2Config, Qwen2ForTokenClassification
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=1, pad_token_id=PAD,
                      num_labels=1, classifier_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForTokenClassification(cfg)


def _worker(cfg, model=None, total_steps=10):
    return CriticWorker(cfg, builtin_tokenizer(), plan=batch_plan(cfg, role="critic"), total_steps=total_steps,
                        device="cpu", model=model)


def _critic_batch(worker, rollout_batch, seed=0, value_noise=0.5):
    """A rollout batch with old `values` (current predictions + noise) and random per-sequence `returns`."""
    batch = rollout_batch(rows=8, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    mask = batch["response_mask"].float()
    values = worker.compute_values(batch)["values"]
    batch["values"] = (values + value_noise * torch.randn(mask.shape, generator=g)) * mask
    batch["returns"] = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape) * mask
    return batch


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _use_sgd(worker, lr: float = 0.1):
    """Plain SGD at a constant lr: the update is the gradient, scale included (Adam's first step is
    ~lr * sign(gradient): it hides a mis-scaled gradient and magnifies the rounding of a near-zero one)."""
    worker.critic.optimizer = torch.optim.SGD(worker.model.parameters(), lr=lr)
    worker.critic.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.critic.optimizer, lambda step: 1.0)


def _update(params, start):
    """What an update changed, by parameter name: compared by norm-relative error (see helpers)."""
    return {k: params[k] - start[k] for k in start}


def test_values_align_with_unpadded_forward(rollout_batch, load_cfg):
    """Value of response token t = head output at the position just before it, row by row without padding."""
    model = _value_model().eval()
    batch = rollout_batch(rows=8, seed=3)
    with torch.no_grad():
        got = response_values(model, batch)
    P = batch["prompts"].shape[1]
    ours, theirs = [], []
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["attention_mask"][i, :P].bool()]
        resp_mask = batch["response_mask"][i].bool()
        response = batch["responses"][i][resp_mask]
        ids = torch.cat([prompt, response]).unsqueeze(0)
        with torch.no_grad():
            v = model(input_ids=ids).logits[0, :, 0]
        expected = v[len(prompt) - 1: len(prompt) - 1 + len(response)]
        ours.append(got[i][resp_mask])
        theirs.append(expected)
        assert torch.all(got[i][~resp_mask] == 0), f"row {i}: padded response positions must be 0"
    assert_close_rel(torch.cat(ours), torch.cat(theirs), name="values")   # one vector: a row's may be ~0
    # the worker's micro-batched, no-grad path gives the same numbers for an uneven split
    worker = _worker(load_cfg(*CRITIC, "critic.forward_micro_batch_size_per_gpu=3"), model=model)
    values = worker.compute_values(batch)["values"]
    assert not values.requires_grad
    assert_close_rel(values, got, name="micro-batched values")
    # packed by a token budget (rows regrouped), then put back in the batch's order
    worker = _worker(load_cfg(*CRITIC, "critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=12",
                              "data.max_prompt_length=5", "data.max_response_length=6"), model=model)
    assert_close_rel(worker.compute_values(batch)["values"], got, name="token-packed values")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_update_does_not_depend_on_micro_batch_size(rollout_batch, load_cfg, agg):
    start = _params(_value_model())
    results = {}
    for micro in ("null", 4, 2, 1, "dynamic"):   # whole mini-batch, halves, quarters, packed by 12 tokens
        by = (["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=12"] if micro == "dynamic"
              else [f"critic.ppo_micro_batch_size_per_gpu={micro}"])
        cfg = load_cfg(*CRITIC, f"critic.loss_agg_mode={agg}", "critic.cliprange_value=0.2", *by,
                       "data.max_prompt_length=5", "data.max_response_length=6")   # longest test sequence: 11
        worker = _worker(cfg, model=_value_model())
        _use_sgd(worker)
        metrics = worker.update_critic(_critic_batch(worker, rollout_batch))
        results[micro] = (_params(worker.model), metrics)
    whole, whole_metrics = results["null"]
    assert _max_diff(whole, start) > 1e-4, "precondition: the update moves the parameters"
    assert 0 < whole_metrics["critic/vf_clipfrac"] < 1, "precondition: both loss branches are exercised"
    for micro in (4, 2, 1, "dynamic"):
        params, metrics = results[micro]
        assert_close_rel(_update(params, start), _update(whole, start), UPDATE_REL,
                         name=f"update with micro-batch {micro}")
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-7), (micro, key)


def test_value_loss_falls_when_fitting_fixed_returns(rollout_batch, load_cfg):
    cfg = load_cfg(*CRITIC, "critic.optim.lr=3e-3", "critic.ppo_epochs=2", "critic.ppo_micro_batch_size_per_gpu=2")
    worker = _worker(cfg, model=_value_model(seed=1))
    batch = _critic_batch(worker, rollout_batch, seed=5, value_noise=0.0)
    mask = batch["response_mask"].bool()

    def mse():
        values = worker.compute_values(batch)["values"]
        return float(((values - batch["returns"])[mask] ** 2).mean())

    start, losses = mse(), []
    for _ in range(8):
        batch["values"] = worker.compute_values(batch)["values"]   # each PPO step re-centres the clipping
        losses.append(worker.update_critic(batch)["critic/vf_loss"])
    assert mse() < 0.3 * start, f"value error {start:.3f} -> {mse():.3f}"
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("cliprange, clipped", [(0.1, True), (100.0, False)])
def test_value_clipping_engages_when_predictions_leave_the_range(rollout_batch, load_cfg, cliprange, clipped):
    """Old values 3 below the predictions, returns 3 above: a clipped prediction is worse, so it is used."""
    cfg = load_cfg(*CRITIC, f"critic.cliprange_value={cliprange}", "critic.optim.weight_decay=0.0",
                   "critic.ppo_mini_batch_size=4")   # one mini-batch: the loss is measured before any step
    worker = _worker(cfg, model=_value_model())
    batch = rollout_batch(rows=8, seed=2)
    mask = batch["response_mask"]
    current = worker.compute_values(batch)["values"]
    batch["values"] = (current - 3.0) * mask
    batch["returns"] = (current + 3.0) * mask
    before = _params(worker.model)
    metrics = worker.update_critic(batch)
    if clipped:
        assert metrics["critic/vf_clipfrac"] == pytest.approx(1.0)
        # the loss is the clipped branch everywhere, which is constant in the prediction: no gradient at all
        assert metrics["critic/grad_norm"] == 0.0
        assert _max_diff(_params(worker.model), before) == 0.0
        assert metrics["critic/vf_loss"] == pytest.approx(0.5 * 5.9 ** 2, rel=1e-4)
    else:
        assert metrics["critic/vf_clipfrac"] == 0.0
        assert metrics["critic/grad_norm"] > 0
        assert metrics["critic/vf_loss"] == pytest.approx(0.5 * 3.0 ** 2, rel=1e-4)


def test_builtin_critic_checkpoint_round_trip(rollout_batch, load_cfg, tmp_path):
    cfg = load_cfg(*CRITIC, "critic.model.path=builtin:tiny", "critic.optim.lr_warmup_steps=3",
                   "critic.optim.lr_warmup_init=2.5e-4")      # the first update moves (verl's warm-up starts at 0)
    worker = _worker(cfg)
    batch = _critic_batch(worker, rollout_batch, seed=7)
    assert torch.all(batch["values"] == batch["values"]), "no NaN"
    assert torch.all(worker.compute_values(batch)["values"] == 0), "a fresh value head predicts exactly 0"
    worker.update_critic(batch)
    worker.save_checkpoint(tmp_path / "critic")

    restored = _worker(cfg)
    assert not torch.equal(restored.compute_values(batch)["values"], worker.compute_values(batch)["values"])
    restored.load_checkpoint(tmp_path / "critic")
    assert torch.equal(restored.compute_values(batch)["values"], worker.compute_values(batch)["values"])
    a, b = worker.optimizer.state_dict(), restored.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in a["state"]:
        for name, t in a["state"][k].items():
            assert torch.equal(t, b["state"][k][name]), (k, name)
    assert restored.scheduler.last_epoch == worker.scheduler.last_epoch == 1
    # resuming continues exactly: one more identical update keeps the two critics equal
    m1, m2 = worker.update_critic(batch), restored.update_critic(batch)
    assert m1 == m2 and m1["critic/lr"] == pytest.approx(1e-3 * 3 / 4)
    assert _max_diff(_params(worker.model), _params(restored.model)) == 0.0


def test_load_checkpoint_rejects_incomplete_directory(load_cfg, tmp_path):
    worker = _worker(load_cfg(*CRITIC), model=_value_model())
    with pytest.raises(FileNotFoundError, match="optim.pt"):
        worker.load_checkpoint(tmp_path / "nothing")


def test_ppo_critic_batch_sizes_follow_verl_keys(load_cfg):
    cfg = load_cfg(*CRITIC, "critic.ppo_micro_batch_size_per_gpu=2")
    model = _value_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    critic = PPOCritic(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), cfg.critic,
                       mini_batch_size=batch_plan(cfg, role="critic").mini_batch_sequences_per_device,
                       max_response_length=cfg.data.max_response_length)
    assert (critic.mini_batch_size, critic.micro_batch_size, critic.forward_micro_batch_size) == (4, 2, 2)


def test_critic_runs_lathe_decoder_packed_equal_to_padded(rollout_batch, load_cfg):
    """A supported transformers critic becomes a LatheValueModel with the same values; its packed update
    (critic.model.use_remove_padding) equals the padded one, and impl=hf keeps the transformers module."""
    from lathe.models.decoder import LatheValueModel
    batch = rollout_batch(rows=8, seed=3)
    hf_model = _value_model()
    with torch.no_grad():
        expected = response_values(hf_model.eval(), batch)
    kept = _worker(load_cfg(*CRITIC, "actor_rollout_ref.model.impl=hf"), model=hf_model)
    assert kept.model is hf_model
    g = torch.Generator().manual_seed(9)
    returns = torch.randn(8, 1, generator=g).expand(batch["response_mask"].shape) * batch["response_mask"]
    results = {}
    for packed in ("false", "true"):
        worker = _worker(load_cfg(*CRITIC, f"critic.model.use_remove_padding={packed}",
                                  "critic.ppo_micro_batch_size_per_gpu=2"), model=_value_model())
        assert isinstance(worker.model, LatheValueModel)
        values = worker.compute_values(batch)["values"]
        assert_close_rel(values, expected, name="lathe values vs transformers'")
        batch["values"], batch["returns"] = values + 0.3 * returns, returns
        metrics = worker.update_critic(batch)
        results[packed] = (_params(worker.model), metrics)
    assert _max_diff(results["false"][0], _params(_value_model())) > 1e-4, "precondition: the update moves weights"
    start = _params(_value_model())
    assert_close_rel(_update(results["true"][0], start), _update(results["false"][0], start), UPDATE_REL,
                     name="packed update")
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
        assert results["true"][1][key] == pytest.approx(results["false"][1][key], rel=1e-5, abs=1e-7), key


def test_shuffle_cuts_each_epochs_own_order_into_mini_batches(rollout_batch, load_cfg):
    """critic.shuffle=true (or the actor's, by default): each epoch's mini-batches are the cuts of its order
    (`EpochShuffle` from critic.data_loader_seed and the update count); false: the batch's order."""
    from lathe.train.update import EpochShuffle
    for shuffle in ("true", "false"):
        cfg = load_cfg(*CRITIC, "critic.ppo_epochs=2", f"actor_rollout_ref.actor.shuffle={shuffle}",
                       "critic.data_loader_seed=4")
        worker = _worker(cfg, model=_value_model())
        batch = _critic_batch(worker, rollout_batch)
        batch["row"] = torch.arange(len(batch))
        seen = []
        worker.critic._update_mini_batch = lambda mini: seen.append(mini["row"].tolist()) or {}
        worker.update_critic(batch)
        orders = ([EpochShuffle(4, 0).order(batch, e) for e in range(2)] if shuffle == "true"
                  else [list(range(8))] * 2)
        assert seen == [orders[0][:4], orders[0][4:], orders[1][:4], orders[1][4:]], shuffle
