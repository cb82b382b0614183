"""verl's `model.override_config.attn_implementation` chooses the decoder's packed attention: refused by name before
anything loads, checked against the device when the actor is built, kept out of the checkpoint's config; the
flash-attn-4 backend against SDPA on a Hopper GPU."""

import pytest
import torch

from lathe.config import ConfigError, load_config
from lathe.loop.setup import hf_overrides
from lathe.models.attention import GroupedAttention, PackedAttention, causal_at_end, set_attention
from lathe.models import flash4

from helpers import assert_close_rel

KEY = "actor_rollout_ref.model.override_config.attn_implementation"


@pytest.mark.parametrize("value", ["flash_attention_2", "flash_attention_4", "sdpa", "eager"])
def test_known_names_load(value):
    cfg = load_config(None, [f"+{KEY}={value}"])
    assert cfg.actor_rollout_ref.model.override_config["attn_implementation"] == value


@pytest.mark.parametrize("value, says", [("flash_attention_3", "flash-attn-4"), ("flex_attention", "one of")])
def test_unknown_names_are_refused_up_front(value, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, [f"+{KEY}={value}"])


class _Decoder(torch.nn.Module):
    attn_backend = "auto"


def test_set_attention_acts_or_explains():
    cpu = torch.device("cpu")
    model = _Decoder()
    set_attention(model, None, cpu, torch.float32)
    assert model.attn_backend == "auto"
    set_attention(model, "eager", cpu, torch.float32)
    assert model.attn_backend == "sdpa"
    with pytest.raises(ValueError, match="NVIDIA GPUs only"):
        set_attention(_Decoder(), "flash_attention_4", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="needs CUDA"):
        set_attention(_Decoder(), "flash_attention_2", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="not lathe's decoder"):
        set_attention(torch.nn.Linear(2, 2), "sdpa", cpu, torch.float32)


def test_a_transformers_model_gets_it_through_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    model = Qwen2ForCausalLM(cfg)
    set_attention(model, "eager", torch.device("cpu"), torch.float32)
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="not lathe's decoder"):
        set_attention(model, "flash_attention_4", torch.device("cpu"), torch.float32)


def test_the_choice_is_not_a_checkpoint_config_value():
    assert hf_overrides({"attn_implementation": "sdpa", "attention_dropout": 0.1}) == {"attention_dropout": 0.1}


def _fa4_ready():
    return torch.cuda.is_available() and flash4.unavailable(torch.device("cuda"), torch.bfloat16) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_ready(), reason="needs flash-attn-4 and a Hopper or Blackwell GPU")
@pytest.mark.parametrize("heads", [(12, 2, 128), (14, 2, 64)])
def test_fa4_equals_sdpa_in_value_and_gradients(heads):
    hq, hkv, d = heads
    g = torch.Generator("cuda").manual_seed(0)
    lengths = [37, 128, 5, 300]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), h, d, device="cuda", generator=g, dtype=torch.bfloat16)
               for h in (hq, hkv, hkv))
    grad = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for backend in ("fa4", "sdpa"):
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        out = PackedAttention(cu, max(lengths), backend)(qq, kk, vv)
        results.append([out, *torch.autograd.grad(out, (qq, kk, vv), grad)])
    for name, a, b in zip(("output", "dq", "dk", "dv"), *results):
        assert_close_rel(a.float(), b.float(), rel=2e-2, name=name)


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_ready(), reason="needs flash-attn-4 and a Hopper or Blackwell GPU")
def test_fa4_aligns_causal_at_the_end_of_each_segment():
    """The prefix-grouped forward's segments: fewer queries than keys, the queries the last of them."""
    g = torch.Generator("cuda").manual_seed(1)
    cu_q = torch.tensor([0, 3, 67], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 40, 104], dtype=torch.int32, device="cuda")
    q = torch.randn(67, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(104, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    out = GroupedAttention(cu_q, cu_k, torch.arange(104, device="cuda"), 64, 64, "fa4")(q, k, v)
    ref = []
    for a, b, c, e in ((0, 3, 0, 40), (3, 67, 40, 104)):
        ks, vs = (x[c:e].transpose(0, 1).repeat_interleave(2, 0).float() for x in (k, v))
        ref.append(torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), ks, vs, attn_mask=causal_at_end(b - a, e - c, q.device)).transpose(0, 1))
    assert_close_rel(out.float(), torch.cat(ref), rel=2e-2, name="output")


def test_the_trainer_runs_the_actor_and_the_reference_on_the_choice(tmp_path):
    from lathe.loop.setup import build_trainer
    cfg = load_config(None, [
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=4", "trainer.logger=[console]", "actor_rollout_ref.model.warm_start.steps=0",
        "actor_rollout_ref.actor.use_kl_loss=true", f"trainer.default_local_dir={tmp_path}", f"+{KEY}=eager"])
    trainer = build_trainer(cfg)
    try:
        worker = trainer.worker
        assert worker.actor.model.attn_backend == "sdpa" and worker.ref.model.attn_backend == "sdpa"
    finally:
        trainer.close()
