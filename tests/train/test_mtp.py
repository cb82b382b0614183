"""The MTP loss of the actor's update (`lathe.train.mtp`): against an independent float64 reference written from MiMo's
architecture, `detach_encoder`'s gradients, micro-batch invariance inside `PPOActor`, and the config rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lathe.config import ConfigError, batch_plan
from lathe.models import load_lathe_model
from lathe.models.io import read_state_dict
from lathe.train.actor import PPOActor
from lathe.train.logprob import response_log_probs
from lathe.train.mtp import MtpTraining, mtp_loss, mtp_training, token_counts
from lathe.train.optim import build_scheduler

from helpers import assert_close_rel
from models.mimo_tiny import save_mimo

from .conftest import UPDATE_REL, VOCAB

FACTOR = 0.2


@pytest.fixture
def mimo(tmp_path):
    """mimo(layers) -> the directory of a tiny MiMo checkpoint over the train tests' vocabulary."""
    return lambda layers=1: save_mimo(tmp_path / f"mimo{layers}", layers=layers, vocab_size=VOCAB)[0]


def masked_batch(rollout_batch, rows=8, seed=0):
    """A rollout batch whose response_mask also has holes inside responses (tool-output tokens verl masks)."""
    batch = rollout_batch(rows=rows, seed=seed)
    mask = batch["response_mask"].clone()
    mask[::3, 1] = 0
    batch["response_mask"] = mask
    return batch


# ---- the float64 reference, from the architecture alone (no lathe code) ----

def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _attention(x, w, p, c):
    n, heads, kv = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"]
    d = c["hidden_size"] // heads
    q = (x @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).view(n, heads, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).view(n, kv, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).view(n, kv, d)
    pos = torch.arange(n)
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return out @ w[p + "self_attn.o_proj.weight"].T


def _mtp_layer(h, e, w, k, c):
    p, eps = f"model.mtp_layers.{k}.", c["rms_norm_eps"]
    z = torch.cat([_rms(h, w[p + "hidden_layernorm.weight"], eps), _rms(e, w[p + "token_layernorm.weight"], eps)], -1)
    z = z @ w[p + "input_proj.weight"].T
    z = z + _attention(_rms(z, w[p + "input_layernorm.weight"], eps), w, p, c)
    y = _rms(z, w[p + "post_attention_layernorm.weight"], eps)
    y = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T))
    z = z + y @ w[p + "mlp.down_proj.weight"].T
    return _rms(z, w[p + "final_layernorm.weight"], eps)


def reference_mtp_loss(path, batch, layers: int, factor: float) -> tuple[float, list[float]]:
    """(the scaled MTP loss, CE_k per layer) in float64, one sequence at a time, from the checkpoint's tensors: the
    main hidden states from transformers' Qwen2 over the sequence alone, MTP layer k predicting token t+k+2 from
    position t, counted where that token is a response token (response_mask), lm_head shared."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    c = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in read_state_dict(path).items()}
    main = {k: v for k, v in w.items() if not k.startswith("model.mtp_layers.")}
    hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")}))
    hf.load_state_dict(main)
    hf = hf.double().eval()
    sums, counts = [0.0] * layers, [0.0] * layers
    R = batch["responses"].shape[1]
    for row in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][row].bool()
        x = batch["input_ids"][row][real]
        full = torch.zeros_like(batch["attention_mask"][row], dtype=torch.float64)
        full[-R:] = batch["response_mask"][row].double()
        m = full[real]
        n = len(x)
        with torch.no_grad():
            h = hf.model(input_ids=x[None]).last_hidden_state[0]
        for k in range(layers):
            shifted = torch.cat([x[k + 1:], torch.zeros(k + 1, dtype=x.dtype)])[:n]
            h = _mtp_layer(h, w["model.embed_tokens.weight"][shifted], w, k, c)
            logp = torch.log_softmax(h @ w["lm_head.weight"].T, -1)
            for t in range(n - k - 2):
                if m[t + k + 2] > 0:
                    sums[k] -= float(logp[t, x[t + k + 2]]) * float(m[t + k + 2])
                    counts[k] += float(m[t + k + 2])
    ces = [s / c for s, c in zip(sums, counts)]
    return factor / layers * sum(ces), ces


@pytest.mark.parametrize("layers", [1, 2])
def test_mtp_loss_equals_a_float64_reference(mimo, rollout_batch, layers):
    path = mimo(layers)
    batch = masked_batch(rollout_batch)
    model = load_lathe_model(path, torch.float64)
    mtp = MtpTraining(FACTOR, False, layers)
    stream = []
    with torch.no_grad():
        response_log_probs(model, batch, keep=stream)
        loss, parts = mtp_loss(model, batch, stream[0], token_counts(batch, mtp), mtp)
    want, ces = reference_mtp_loss(path, batch, layers, FACTOR)
    assert abs(float(loss) - want) / want < 1e-6
    for k, ce in enumerate(ces):
        assert abs(float(parts[f"actor/mtp_losses/mtp_{k + 1}_loss"]) - ce) / ce < 1e-6


def test_the_host_layout_path_gives_the_same_loss(mimo, rollout_batch):
    from lathe.train.micro import with_host_mask
    model = load_lathe_model(mimo(2))
    batch = masked_batch(rollout_batch)
    mtp = MtpTraining(FACTOR, False, 2)
    losses = []
    for b in (batch, with_host_mask(batch)):        # packed on the device, or from the host mask's layout
        stream = []
        with torch.no_grad():
            response_log_probs(model, b, keep=stream, remove_padding=True)
            losses.append(float(mtp_loss(model, b, stream[0], token_counts(b, mtp), mtp)[0]))
    assert abs(losses[0] - losses[1]) / losses[0] < 1e-6


@pytest.mark.parametrize("detach", [True, False])
def test_detach_encoder_keeps_the_mtp_gradient_in_the_mtp_layers(mimo, rollout_batch, detach):
    model = load_lathe_model(mimo())
    batch = masked_batch(rollout_batch)
    mtp = MtpTraining(FACTOR, detach, 1)
    stream = []
    response_log_probs(model, batch, keep=stream)
    loss, _ = mtp_loss(model, batch, stream[0], token_counts(batch, mtp), mtp)
    loss.backward()

    def grad_norm(prefix):
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(prefix) and p.grad is not None]
        return sum(float(g.norm()) for g in grads)
    assert grad_norm("model.mtp_layers.") > 0
    assert grad_norm("lm_head.") == 0                  # verl: the MTP loss never trains lm_head
    main = grad_norm("model.layers.") + grad_norm("model.norm.")
    embed = grad_norm("model.embed_tokens.")
    if detach:
        assert main == 0 and embed == 0
    else:
        assert main > 0 and embed > 0


def test_micro_batches_add_up_to_the_whole_mini_batch(mimo, rollout_batch):
    model = load_lathe_model(mimo(2))
    batch = masked_batch(rollout_batch)
    mtp = MtpTraining(FACTOR, False, 2)
    counts = token_counts(batch, mtp)

    def loss_of(part):
        stream = []
        response_log_probs(model, part, keep=stream)
        return mtp_loss(model, part, stream[0], counts, mtp)[0]
    whole = loss_of(batch)
    parts = [loss_of(p) for p in batch.split(3)]
    assert abs(float(sum(parts).detach()) - float(whole.detach())) / float(whole.detach()) < 1e-6


def _actor(model, cfg, mtp):
    arr = cfg.actor_rollout_ref
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                    mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device,
                    temperature=arr.rollout.temperature, max_response_length=cfg.data.max_response_length,
                    use_remove_padding=arr.model.use_remove_padding, mtp=mtp)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_the_actor_update_trains_the_mtp_layers_whatever_the_micro_batches(mimo, rollout_batch, load_cfg,
                                                                           remove_padding):
    path = mimo()
    batch = masked_batch(rollout_batch)
    with torch.no_grad():
        logp, _ = response_log_probs(load_lathe_model(path), batch)
    g = torch.Generator().manual_seed(5)     # old log-probs off the policy, so the PPO ratios are not all 1
    batch["old_log_probs"] = logp + 0.1 * torch.randn(logp.shape, generator=g) * batch["response_mask"]
    batch["advantages"] = torch.randn(logp.shape[0], 1, generator=g).expand(logp.shape) * batch["response_mask"]
    results = {}
    for micro in ("null", 1):
        cfg = load_cfg(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       f"actor_rollout_ref.model.use_remove_padding={str(remove_padding).lower()}",
                       "actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
                       f"actor_rollout_ref.model.mtp.mtp_loss_scaling_factor={FACTOR}",
                       "actor_rollout_ref.actor.grad_clip=1000.0", "data.max_prompt_length=5",
                       "data.max_response_length=6")
        model = load_lathe_model(path)
        start = {k: v.detach().clone() for k, v in model.named_parameters()}
        metrics = _actor(model, cfg, mtp_training(cfg.actor_rollout_ref.model.mtp, model, "tiny MiMo")
                         ).update_policy(batch)
        results[micro] = ({k: v.detach() - start[k] for k, v in model.named_parameters()}, metrics)
    (whole, m_whole), (split, m_split) = results["null"], results[1]
    assert float(whole["model.mtp_layers.0.input_proj.weight"].norm()) > 0
    assert m_whole["actor/mtp_losses/mtp_1_loss"] > 0
    assert abs(m_split["actor/mtp_losses/mtp_1_loss"] - m_whole["actor/mtp_losses/mtp_1_loss"]) < 1e-5
    assert_close_rel(split, whole, UPDATE_REL, name="update with micro-batch 1")


def test_enable_train_on_a_model_without_mtp_layers_fails_naming_the_model_and_the_key(tmp_path, load_cfg):
    path, _ = save_mimo(tmp_path / "m", vocab_size=VOCAB, with_mtp=False)
    cfg = load_cfg("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true")
    with pytest.raises(ValueError, match=r"mtp\.enable_train=true, but the policy MiMoForCausalLM \(.*m\) has no"):
        mtp_training(cfg.actor_rollout_ref.model.mtp, load_lathe_model(path), f"MiMoForCausalLM ({path})")
    assert mtp_training(load_cfg().actor_rollout_ref.model.mtp, load_lathe_model(path), "x") is None


@pytest.mark.parametrize("override, named", [
    ("actor_rollout_ref.model.lora_rank=4", "lora_rank=4"),
    ("actor_rollout_ref.actor.use_prefix_grouper=true", "use_prefix_grouper=true"),
    ("actor_rollout_ref.model.impl=hf", "impl=hf"),
])
def test_what_mtp_training_does_not_combine_with_is_refused_up_front(load_cfg, override, named):
    with pytest.raises(ConfigError) as err:
        load_cfg("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
                 "actor_rollout_ref.model.use_remove_padding=true", "trainer.n_gpus_per_node=2", override)
    assert named in str(err.value) and "mtp.enable_train=false" in str(err.value)


@pytest.mark.parametrize("override", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                                      "actor_rollout_ref.actor.megatron.context_parallel_size=2"])
def test_mtp_training_beside_ulysses_loads(load_cfg, override):
    """(lathe.train.mtp under Ulysses: tests/train/test_mtp_ulysses.py)"""
    cfg = load_cfg("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true",
                   "actor_rollout_ref.model.use_remove_padding=true", "trainer.n_gpus_per_node=2", override)
    assert cfg.actor_rollout_ref.model.mtp.enable_train
    assert batch_plan(cfg).sequence_parallel_size == 2

