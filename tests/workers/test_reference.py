"""The reference worker part (`lathe.workers.reference`): `ref.quantization=fp8`, its projections in FP8."""

import warnings

import pytest
import torch
from torch import nn

from lathe.config import ConfigError, load_config
from lathe.data.builtin import builtin_tokenizer
from lathe.models.hf import build_builtin_model
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import assert_close_rel, plan_of

KEY = "actor_rollout_ref.ref.quantization"
KL = "actor_rollout_ref.actor.use_kl_loss=true"


def _worker(load_cfg, *overrides, device="cpu"):
    cfg = load_cfg("actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.model.use_remove_padding=true", KL,
                   *overrides)
    tok = builtin_tokenizer()
    return ActorRolloutRefWorker(cfg, build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok,
                                 plan=plan_of(cfg, needs_ref=True), total_steps=10, device=torch.device(device))


def _e4m3_rows(t: torch.Tensor) -> torch.Tensor:
    """t rounded through E4M3, each row scaled by its largest magnitude / 448 (the formula, written here)."""
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def test_an_fp8_reference_multiplies_each_projection_through_e4m3(load_cfg, rollout_batch):
    """Its log-probs equal a full-precision reference's whose seven projections a layer take their input and weight
    rounded through E4M3 (per token, per output channel), and differ from the plain reference's by that rounding."""
    batch = rollout_batch(rows=8, seed=3)
    quantised = _worker(load_cfg, f"{KEY}=fp8")
    got = quantised.compute_ref_log_prob(batch)["ref_log_prob"]
    plain = _worker(load_cfg)
    base = plain.compute_ref_log_prob(batch)["ref_log_prob"]
    linears = [m for layer in plain.ref.model.model.layers for m in layer.modules() if type(m) is nn.Linear]
    assert len(linears) == 7 * len(plain.ref.model.model.layers)
    for lin in linears:
        lin.forward = lambda x, lin=lin: nn.functional.linear(_e4m3_rows(x), _e4m3_rows(lin.weight), lin.bias)
    expected = plain.compute_ref_log_prob(batch)["ref_log_prob"]
    assert_close_rel(got, expected, 1e-5)
    mask = batch["response_mask"].bool()
    gap = (got - base)[mask].abs()
    assert 0 < float(gap.max()) < 0.1, "FP8 rounding: present, and small"
    assert torch.equal(quantised.compute_log_prob(batch)["old_log_probs"],
                       plain.compute_log_prob(batch)["old_log_probs"]), "the actor's own pass stays as it was"


@pytest.mark.parametrize("overrides, match", [
    ([f"{KEY}=int8"], "fp8 only"),
    ([f"{KEY}=fp8", "actor_rollout_ref.model.lora_rank=8"], "adapters off"),
    ([f"{KEY}=fp8", "actor_rollout_ref.model.impl=hf", "actor_rollout_ref.rollout.name=hf"], "lathe's decoder"),
    ([f"{KEY}=fp8", "trainer.n_gpus_per_node=2"], "2 trainer devices"),
    ([f"{KEY}=fp8", "actor_rollout_ref.ref.fsdp_config.param_offload=true"], "param_offload=false")])
def test_what_an_fp8_reference_cannot_be_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(None, [KL, *overrides])
    assert KEY in str(err.value) and "Fix:" in str(err.value)


def test_an_fp8_reference_in_a_run_without_one_says_it_does_nothing():
    with pytest.warns(UserWarning, match=f"{KEY}=fp8 has no effect"):
        load_config(None, [f"{KEY}=fp8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, [f"{KEY}=fp8", KL])


@pytest.mark.gpu
def test_an_fp8_reference_on_a_gpu(load_cfg, rollout_batch):
    """The real FP8 products (torch._scaled_mm, the reference's layers compiled) in bf16: close to the bf16
    reference's log-probs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9 or later")
    from lathe.engine.fp8 import Fp8Linear
    gpu = ("actor_rollout_ref.rollout.gpu_memory_utilization=0.2", "data.max_prompt_length=24",
           "data.max_response_length=12")
    batch = rollout_batch(rows=8, seed=3)
    quantised = _worker(load_cfg, *gpu, f"{KEY}=fp8", device="cuda")
    assert sum(type(m) is Fp8Linear for m in quantised.ref.model.modules()) >= 4 * len(quantised.ref.model.model.layers)
    got = quantised.compute_ref_log_prob(batch)["ref_log_prob"]
    base = _worker(load_cfg, *gpu, device="cuda").compute_ref_log_prob(batch)["ref_log_prob"]
    mask = batch["response_mask"].bool()
    gap = (got.float() - base.float())[mask].abs()
    assert torch.isfinite(got).all() and 0 < float(gap.mean()) < 0.05, float(gap.mean())
