"""The trainer's compile switches: verl's `actor.use_torch_compile` / `actor.fsdp_config.use_torch_compile` and
`critic.model.fsdp_config.use_torch_compile` compile lathe's decoder (on CUDA by default), and a compiled update
equals the eager one. CPU compilation is switched on here through `lathe.models.compile`'s two knobs, with the
`aot_eager` backend (same tracing and guards as inductor, no code generation) to keep the tests fast.
"""

import pytest
import torch

from lathe.config import batch_plan

import lathe.models.compile as compile_mod
from lathe.models.decoder import LatheCausalLM, LatheValueModel
from lathe.train.actor import PPOActor, use_torch_compile
from lathe.train.optim import build_scheduler

from helpers import assert_close_rel

from .conftest import UPDATE_REL
from .test_actor import _max_diff, _params, _ppo_batch, _update
from .test_critic import CRITIC, _critic_batch, _use_sgd, _value_model, _worker

ACTOR = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
         "actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.actor.grad_clip=1000.0"]


@pytest.fixture
def compile_on_cpu(monkeypatch):
    """use_torch_compile=true compiles on CPU too, with the aot_eager backend; dynamo caches start empty."""
    monkeypatch.setattr(compile_mod, "COMPILE_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(compile_mod, "DEFAULT_BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _actor(model, cfg, remove_padding=True):
    """A PPOActor with plain SGD: Adam's first step turns the rounding noise of near-zero gradients (a k_proj
    weight here) into full +-lr steps, which would hide whether compiled and eager gradients agree."""
    arr = cfg.actor_rollout_ref
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PPOActor(model, optimizer, build_scheduler(optimizer, arr.actor.optim, total_steps=10), arr.actor,
                    mini_batch_size=batch_plan(cfg).mini_batch_sequences_per_device, temperature=arr.rollout.temperature,
                    max_response_length=cfg.data.max_response_length, use_remove_padding=remove_padding)


def test_compiled_actor_update_equals_eager(compile_on_cpu, make_model, make_lathe, rollout_batch, load_cfg):
    batch = _ppo_batch(make_model(), rollout_batch, temperature=0.7)
    results = {}
    for switch in ("false", "true"):
        model = make_lathe()
        actor = _actor(model, load_cfg(*ACTOR, f"actor_rollout_ref.actor.use_torch_compile={switch}"))
        assert actor.compiled is (switch == "true") and (model.compile_backend is not None) is actor.compiled
        metrics = actor.update_policy(batch)
        results[switch] = (_params(model), metrics)
    start = _params(make_lathe())
    assert _max_diff(results["false"][0], start) > 1e-3, "precondition: the update moves weights"
    assert_close_rel(_update(results["true"][0], start), _update(results["false"][0], start), UPDATE_REL,
                     name="compiled update")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert results["true"][1][key] == pytest.approx(results["false"][1][key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("override, compiled", [
    (None, True),
    ("actor_rollout_ref.actor.use_torch_compile=false", False),
    ("actor_rollout_ref.actor.fsdp_config.use_torch_compile=false", False),
])
def test_actor_switches(compile_on_cpu, make_lathe, load_cfg, override, compiled):
    cfg = load_cfg(*([override] if override else []))
    assert use_torch_compile(cfg.actor_rollout_ref.actor) is compiled
    model = make_lathe()
    assert _actor(model, cfg).compiled is compiled
    assert all((layer._compiled_call_impl is not None) is compiled for layer in model.model.layers)


def test_actor_on_cpu_stays_eager_by_default(make_model, make_lathe, load_cfg):
    cfg = load_cfg()
    assert cfg.actor_rollout_ref.actor.use_torch_compile, "precondition: verl's default is on"
    lathe, hf = make_lathe(), make_model()
    assert not _actor(lathe, cfg).compiled and lathe.compile_backend is None
    assert isinstance(lathe, LatheCausalLM) and not _actor(hf, cfg, remove_padding=False).compiled


def test_critic_switch_and_compiled_update_equals_eager(compile_on_cpu, rollout_batch, load_cfg):
    results = {}
    for switch in ("false", "true"):
        worker = _worker(load_cfg(*CRITIC, "critic.model.use_remove_padding=true",
                                  f"critic.model.fsdp_config.use_torch_compile={switch}"), model=_value_model())
        assert isinstance(worker.model, LatheValueModel)
        assert worker.critic.compiled is (switch == "true") and (worker.model.compile_backend is not None) is (
            switch == "true")
        _use_sgd(worker)
        batch = _critic_batch(worker, rollout_batch, seed=2)
        metrics = worker.update_critic(batch)
        results[switch] = (_params(worker.model), metrics, batch["values"])
    assert_close_rel(results["true"][2], results["false"][2], name="compiled values")
    start = _params(_value_model())
    assert _max_diff(results["false"][0], start) > 1e-4, "precondition: the update moves weights"
    assert_close_rel(_update(results["true"][0], start), _update(results["false"][0], start), UPDATE_REL,
                     name="compiled update")
    assert results["true"][1]["critic/vf_loss"] == pytest.approx(results["false"][1]["critic/vf_loss"], rel=1e-5)
