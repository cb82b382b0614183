"""Issue 17: a vision-language `actor_rollout_ref.model.path` builds the actor and reference on lathe's VL model;
its rollout is lathe's engine (transformers generate is refused); its log-probs and updates run through the
worker."""

import pytest
import torch

from lathe.config import load_config
from lathe.data.multimodal import tiny_vl_processor
from lathe.models.hf import ModelLoadError, load_policy
from lathe.models.vl import LatheVLForConditionalGeneration
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import plan_of

from models.vl_tiny import save_hf

from train.test_vl_logprob import vl_rollout_batch


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
    from lathe.generation import SamplingParams
    tok = tiny_vl_processor().tokenizer
    key = "actor_rollout_ref.rollout.name=hf"
    with pytest.raises(NotImplementedError, match=f"{key.split('=')[0]}.*vision-language"):
        cfg = _cfg(vl_dir, tmp_path, key)
        ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tok, plan=plan_of(cfg, needs_ref=False), total_steps=1,
                              device=torch.device("cpu"))
    cfg = _cfg(vl_dir, tmp_path)
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tok, plan=plan_of(cfg, needs_ref=False),
                                   total_steps=1, device=torch.device("cpu"))
    assert worker.rollout.name == "lathe"
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
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tiny_vl_processor().tokenizer,
                                   plan=plan_of(cfg, needs_ref=True), total_steps=1, device=torch.device("cpu"),
                                   rollout=False)
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


def _changed_by_an_update(worker, seed: int) -> set[str]:
    """The state-dict names one PPO update of `worker` changes, on the image rollout batch with random advantages."""
    batch = vl_rollout_batch()
    batch.update(worker.compute_log_prob(batch))
    batch.update(worker.compute_ref_log_prob(batch))
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(seed)) * batch["response_mask"]
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    worker.update_actor(batch)
    return {k for k, v in worker.model.state_dict().items() if not torch.equal(v, before[k])}


def test_freeze_vision_tower_trains_the_language_model_only(vl_dir, tmp_path):
    """verl's actor.freeze_vision_tower: after an update the vision tower is unchanged and out of the optimizer, the
    language model moved; a text policy refuses the key."""
    cfg = _cfg(vl_dir, tmp_path, "actor_rollout_ref.actor.freeze_vision_tower=true")
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tiny_vl_processor().tokenizer,
                                   plan=plan_of(cfg, needs_ref=True), total_steps=1, device=torch.device("cpu"),
                                   rollout=False)
    changed = _changed_by_an_update(worker, seed=1)
    assert changed and not any(k.startswith("model.visual.") for k in changed)
    assert any(k.startswith("model.language_model.") for k in changed)
    trained = {id(p) for g in worker.actor.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in trained for p in worker.model.model.visual.parameters())
    from lathe.data.builtin import builtin_tokenizer
    from lathe.models.hf import build_builtin_model
    tok = builtin_tokenizer()
    with pytest.raises(ValueError, match="freeze_vision_tower=true: the policy is a text model"):
        text_cfg = load_config(None, ["actor_rollout_ref.model.path=builtin:tiny",
                                      "actor_rollout_ref.actor.freeze_vision_tower=true"])
        ActorRolloutRefWorker(text_cfg, build_builtin_model("tiny", vocab_size=len(tok), seed=0), tok,
                              plan=plan_of(text_cfg, needs_ref=False), total_steps=1, device=torch.device("cpu"),
                              rollout=False)


def test_lora_on_a_vl_model_adapts_the_language_model_and_the_engine_runs_merged(vl_dir, tmp_path):
    """LoRA on a VL policy: adapters on the language model's layers only (the vision tower frozen), only they change
    in an update, the engine holds the merged weights (its own plain layers), and the checkpoint holds the PEFT
    adapter and a merged model that loads as the VL model."""
    from lathe.models.lora import lora_layers
    from lathe.models.vl import load_lathe_vl_model
    cfg = _cfg(vl_dir, tmp_path, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    worker = ActorRolloutRefWorker(cfg, load_policy(str(vl_dir)), tiny_vl_processor().tokenizer,
                                   plan=plan_of(cfg, needs_ref=True), total_steps=1, device=torch.device("cpu"))
    adapted = dict(lora_layers(worker.model))
    assert adapted and all(p.startswith("model.language_model.layers.") for p in adapted)
    assert not list(lora_layers(worker.rollout.backend.model))               # the engine's copy: plain merged layers
    changed = _changed_by_an_update(worker, seed=2)
    worker.sync_weights()
    assert changed and all(k.endswith((".lora_A", ".lora_B")) for k in changed)
    engine = worker.rollout.backend.model.state_dict()
    for path, layer in adapted.items():
        want = layer.weight.float() + layer.delta()
        assert torch.allclose(engine[f"{path}.weight"].float(), want, atol=1e-6), path
    worker.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "lora_adapter" / "adapter_config.json").is_file()
    merged = load_lathe_vl_model(tmp_path / "ckpt" / "huggingface").state_dict()
    for path in adapted:
        assert torch.allclose(merged[f"{path}.weight"].float(), engine[f"{path}.weight"].float(), atol=1e-6), path


@pytest.mark.parametrize("family", ["qwen2_5_vl", "glm4v"])
def test_peft_loads_a_vl_adapter_to_the_same_logits(tmp_path, family):
    """A VL model's adapter, saved in PEFT's layout, loads onto transformers' Qwen2.5-VL (GLM-4.1V: its q/k rows and
    gate_up_proj in the checkpoint's layout, `lathe.models.glm4`) with PEFT to the same logits on a ragged image
    batch."""
    peft = pytest.importorskip("peft")
    from lathe.models.lora import apply_lora, lora_layers, save_adapter
    from lathe.models.vl import load_lathe_vl_model
    from models.vl_tiny import ragged_vl_batch
    path, hf = save_hf(tmp_path, family)
    model = load_lathe_vl_model(path)
    apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.normal_(0, 0.1)
    save_adapter(model, tmp_path / "adapter", base_model=str(path))
    wrapped = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids, mask, pixels, grid, mm_types = ragged_vl_batch(0)
    with torch.no_grad():
        theirs = wrapped(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                         mm_token_type_ids=mm_types).logits
        ours = model(ids, mask, pixel_values=pixels, image_grid_thw=grid).logits
    from helpers import assert_close_rel
    real = mask.bool()
    assert_close_rel(ours[real], theirs[real], name="VL LoRA logits against PEFT")
