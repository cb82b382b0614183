"""The worker's CUDA path: bf16 compute on fp32 masters, the engine on the actor's own tensors (but for its fused
projections), offload."""

import pytest
import torch

from lathe.config import batch_plan
from lathe.data.builtin import builtin_tokenizer
from lathe.workers.critic import CriticWorker
from lathe.train.master import MasterAdamW
from lathe.rollout.build import build_engine
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import plan_of, worker_ppo_batch

from train.test_critic import CRITIC, _critic_batch, _value_model
from .test_rollout import GREEDY, PROMPT_IDS, SECOND_EOS, _prompts, _qwen2

pytestmark = pytest.mark.gpu


def _cuda_worker(load_cfg, *overrides):
    cfg = load_cfg("actor_rollout_ref.rollout.name=lathe", "data.max_prompt_length=24", "data.max_response_length=12",
                   "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.actor.optim.lr=1e-2",
                   *overrides)
    return ActorRolloutRefWorker(cfg, _qwen2(), builtin_tokenizer(), plan=plan_of(cfg, needs_ref=True),
                                 total_steps=10, device=torch.device("cuda"))


def test_actor_computes_in_bf16_on_fp32_masters_and_the_engine_runs_on_its_tensors(load_cfg, rollout_batch):
    worker = _cuda_worker(load_cfg)
    assert isinstance(worker.actor.optimizer, MasterAdamW)
    masters = worker.actor.optimizer.param_groups[0]["params"]
    assert all(p.dtype == torch.bfloat16 for p in worker.model.parameters())
    assert all(m.dtype == torch.float32 and m.is_cuda for m in masters)
    assert all(p.dtype == torch.bfloat16 for p in worker.ref.model.parameters())
    actor = {n: t.data_ptr() for n, t in worker.model.state_dict().items()}
    engine = worker.rollout.backend.model
    own = {n for n, t in engine.state_dict().items() if actor[n] != t.data_ptr()}
    from lathe.engine.decode_forms import FusedAttention
    fused = isinstance(engine.model.layers[0].self_attn, FusedAttention)    # the engine's q/k/v, gate/up copy
    projections = ("q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj.")
    assert own == ({n for n in actor if any(p in n for p in projections)} if fused else set()), \
        "one copy of every weight but the fused projections (which sync_weights copies)"
    before = [m.clone() for m in masters]
    worker.update_actor(worker_ppo_batch(worker, rollout_batch))
    worker.sync_weights()
    assert any(not torch.equal(a, b) for a, b in zip(masters, before)), "the masters moved"
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(worker.model.parameters(), masters))
    worker.rollout.backend.wake_up()
    after_update = worker.rollout.backend.generate(PROMPT_IDS, GREEDY).token_ids
    worker.rollout.backend.sleep()                    # its KV cache goes back before a second engine sizes its own
    fresh = build_engine(worker.cfg.actor_rollout_ref.rollout, worker.model, [1, SECOND_EOS])
    assert after_update == fresh.generate(PROMPT_IDS, GREEDY).token_ids


EAGER = ["actor_rollout_ref.actor.use_torch_compile=false", "actor_rollout_ref.ref.use_torch_compile=false",
         "actor_rollout_ref.rollout.enforce_eager=true"]     # compilation has its own tests; these only cost time


def test_offloaded_reference_and_optimizer_give_the_same_numbers(load_cfg, rollout_batch):
    plain = _cuda_worker(load_cfg, *EAGER)
    off = _cuda_worker(load_cfg, *EAGER, "actor_rollout_ref.ref.fsdp_config.param_offload=true",
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                       "actor_rollout_ref.actor.fsdp_config.param_offload=true")
    assert all(p.device.type == "cpu" and p.is_pinned() for p in off.ref.model.parameters()), "ref waits in host memory"
    batch = worker_ppo_batch(plain, rollout_batch)
    assert torch.equal(off.compute_ref_log_prob(batch)["ref_log_prob"], batch["ref_log_prob"])
    plain.update_actor(batch)
    off.update_actor(batch)
    plain.sync_weights()
    off.sync_weights()
    moments = off.actor.optimizer.state[off.actor.optimizer.param_groups[0]["params"][0]]
    assert moments["exp_avg"].device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), off.model.parameters()))
    assert torch.equal(off.generate_sequences(_prompts(), GREEDY)["responses"],
                       plain.generate_sequences(_prompts(), GREEDY)["responses"])


def test_critic_trains_in_bf16_on_fp32_masters_and_offload_changes_no_number(load_cfg, rollout_batch):
    def critic(*overrides):
        cfg = load_cfg("algorithm.adv_estimator=gae", "critic.model.fsdp_config.use_torch_compile=false", *CRITIC,
                       *overrides)
        return CriticWorker(cfg, builtin_tokenizer(), plan=batch_plan(cfg, role="critic"), total_steps=10,
                            device=torch.device("cuda"),
                            model=_value_model())
    plain = critic()
    off = critic("critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true")
    assert isinstance(plain.optimizer, MasterAdamW)
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in plain.model.parameters())
    masters = off.optimizer.param_groups[0]["params"]
    assert all(m.dtype == torch.float32 and m.device.type == "cpu" for m in masters), "masters in host memory"
    batch = _critic_batch(plain, rollout_batch)
    assert torch.equal(off.compute_values(batch)["values"], plain.compute_values(batch)["values"])
    metrics = plain.update_critic(batch)
    off.update_critic(batch)
    assert torch.isfinite(torch.tensor(metrics["critic/vf_loss"]))
    assert off.optimizer.state[masters[0]]["exp_avg"].device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), off.model.parameters()))
