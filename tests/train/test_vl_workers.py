"""Issue 17: a vision-language `actor_rollout_ref.model.path` builds the actor and reference on lathe's VL model;
its rollout is lathe's engine (transformers generate is refused); its log-probs and updates run through the
worker."""

import pytest
import torch

from lathe.config import load_config
from lathe.data.multimodal import tiny_vl_processor
from lathe.models.hf import ModelLoadError, load_policy
from lathe.models.vl import LatheVLForConditionalGeneration
from lathe.train.workers import ActorRolloutRefWorker

from models.vl_tiny import save_hf

from .test_vl_logprob import vl_rollout_batch


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    path, _ = save_hf(tmp_path_factory.mktemp("vl"), "qwen2_5_vl")
    return path


def _cfg(path, tmp_path, *extra):
    return load_config(None, [f"actor_rollout_ref.model.path={path}", "data.train_batch_size=3",
                              "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                              "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.model.use_remove_padding=true",
                              f"trainer.default_local_dir={tmp_path}", *extra])


def test_load_policy_builds_lathes_vl_model_and_refuses_impl_hf(vl_dir):
    assert isinstance(load_policy(str(vl_dir)), LatheVLForConditionalGeneration)
    with pytest.raises(ModelLoadError, match=r"impl=hf: .* vision-language checkpoint"):
        load_policy(str(vl_dir), impl="hf")


def test_a_vl_actor_generates_with_the_engine_and_refuses_the_transformers_rollout(vl_dir, tmp_path):
    from lathe.batch import Batch
    from lathe.rollout.base import SamplingParams
    tok = tiny_vl_processor().tokenizer
    for key in ("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.model.lora_rank=4",
                "actor_rollout_ref.rollout.multi_turn.enable=true"):
        with pytest.raises(NotImplementedError, match=f"{key.split('=')[0]}.*vision-language"):
            ActorRolloutRefWorker(_cfg(vl_dir, tmp_path, key), load_policy(str(vl_dir)),
                                  tok, total_steps=1, device=torch.device("cpu"), need_ref=False)
    worker = ActorRolloutRefWorker(_cfg(vl_dir, tmp_path), load_policy(str(vl_dir)), tok, total_steps=1,
                                   device=torch.device("cpu"), need_ref=False)
    assert worker.rollout_name == "lathe"
    rows = vl_rollout_batch()
    P = rows["prompts"].shape[1]
    prompts = Batch(non_tensors={"prompt_ids": [r[m.bool()].tolist() for r, m in
                                                zip(rows["prompts"], rows["attention_mask"][:, :P])],
                                 "multi_modal_inputs": list(rows["multi_modal_inputs"])})
    out = worker.generate_sequences(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=4))
    assert len(out) == 12 and out["multi_modal_inputs"][0] is None and out["multi_modal_inputs"][3] is not None
    logp = worker.compute_log_prob(out)["old_log_probs"]
    assert bool(torch.isfinite(logp).all())


def test_worker_log_probs_reference_and_update_on_image_rows(vl_dir, tmp_path):
    cfg = _cfg(vl_dir, tmp_path)
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tiny_vl_processor().tokenizer, total_steps=1,
                                   device=torch.device("cpu"), need_ref=True, rollout=False)
    assert isinstance(worker.model, LatheVLForConditionalGeneration) and worker.has_ref
    batch = vl_rollout_batch()
    batch.update(worker.compute_log_prob(batch))
    batch.update(worker.compute_ref_log_prob(batch))
    mask = batch["response_mask"]
    assert torch.allclose(batch["old_log_probs"] * mask, batch["ref_log_prob"] * mask, atol=1e-5)
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)) * mask
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    metrics = worker.update_actor(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert max(float((v - before[k]).abs().max()) for k, v in worker.model.state_dict().items()) > 0
    after = worker.compute_log_prob(batch)["old_log_probs"]
    assert float(((after - batch["old_log_probs"]) * mask).abs().max()) > 0


def test_freeze_vision_tower_trains_the_language_model_only(vl_dir, tmp_path):
    """verl's actor.freeze_vision_tower: after an update the vision tower is unchanged and out of the optimizer, the
    language model moved; a text policy refuses the key."""
    cfg = _cfg(vl_dir, tmp_path, "actor_rollout_ref.actor.freeze_vision_tower=true")
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tiny_vl_processor().tokenizer, total_steps=1,
                                   device=torch.device("cpu"), need_ref=True, rollout=False)
    batch = vl_rollout_batch()
    batch.update(worker.compute_log_prob(batch))
    batch.update(worker.compute_ref_log_prob(batch))
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)) * batch["response_mask"]
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    worker.update_actor(batch)
    changed = {k for k, v in worker.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and not any(k.startswith("model.visual.") for k in changed)
    assert any(k.startswith("model.language_model.") for k in changed)
    trained = {id(p) for g in worker.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in trained for p in worker.model.model.visual.parameters())
    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.hf import build_builtin_model
    tok = builtin_tokenizer()
    with pytest.raises(ValueError, match="freeze_vision_tower=true: the policy is a text model"):
        ActorRolloutRefWorker(load_config(None, ["actor_rollout_ref.model.path=builtin:tiny",
                                                 "actor_rollout_ref.actor.freeze_vision_tower=true"]),
                              build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok, total_steps=1,
                              device=torch.device("cpu"), need_ref=False, rollout=False)
