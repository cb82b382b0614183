"""Issue 17 end to end: `lathe train` GRPO on a tiny Qwen2.5-VL checkpoint and a parquet of image prompts (verl's
schema), on the CPU: the processor is found from `model.tokenizer_path`, the engine generates from the images, the
reward sees the responses, the update moves the vision tower too, and a validation pass runs."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lathe.data.multimodal import IMAGE_TOKEN, tiny_vl_processor
from lathe.engine.llm_engine import LatheEngine

from .test_ppo import read_metrics, run

COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (240, 240, 240)]


def _png(colour, size=(16, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _checkpoint(tmp_path, family: str = "qwen2_5_vl"):
    """A random Qwen2.5-VL (or Qwen3.5: hybrid layers; Qwen3-VL-MoE; GLM-4.1V; GLM-4.5V) model whose vocabulary and
    vision tokens are the tiny processor's (saved apart: a tokenizer beside a qwen config.json would be read as Qwen2's)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    processor = tiny_vl_processor()
    tok = processor.tokenizer
    ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("image_token_id", IMAGE_TOKEN),
                                                           ("vision_start_token_id", "<|vision_start|>"),
                                                           ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, window_size=16,
                  fullatt_block_indexes=[0])
    torch.manual_seed(0)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"):
        import transformers
        vision = {k: v for k, v in vision.items() if k not in ("window_size", "fullatt_block_indexes")}
        vision["num_position_embeddings"] = 16
        if family.endswith("moe"):      # both layers sparse
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        if family.startswith("qwen3_5"):
            text.update(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
            if family == "qwen3_5_moe":
                del text["intermediate_size"]
                text["shared_expert_intermediate_size"] = 24
        else:       # Qwen3-VL-MoE: deepstack features from the vision block
            text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [4, 2, 2], "mrope_interleaved": True})
            vision["deepstack_visual_indexes"] = [0]
        name = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_vl_moe": "Qwen3VLMoe"}[family]
        cfg = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision,
                                                     video_token_id=len(tok) + 1, tie_word_embeddings=False, **ids)
        getattr(transformers, f"{name}ForConditionalGeneration")._from_config(cfg).save_pretrained(tmp_path / "model")
    elif family in ("glm4v", "glm4v_moe"):     # RoPE over half of each head; their own marker keys
        import transformers
        vision = {k: v for k, v in vision.items() if k not in ("window_size", "fullatt_block_indexes")}
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1]}
        if family == "glm4v_moe":       # GLM-4.5's layers: layer 0 dense, layer 1 sparse
            text.update(head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        moe_intermediate_size=16, first_k_dense_replace=1)
        name = {"glm4v": "Glm4v", "glm4v_moe": "Glm4vMoe"}[family]
        cfg = getattr(transformers, f"{name}Config")(
            text_config=text, vision_config={**vision, "image_size": 16}, video_token_id=len(tok) + 1,
            image_token_id=ids["image_token_id"], image_start_token_id=ids["vision_start_token_id"],
            image_end_token_id=ids["vision_end_token_id"])
        getattr(transformers, f"{name}ForConditionalGeneration")._from_config(cfg).save_pretrained(tmp_path / "model")
    else:
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, video_token_id=len(tok) + 1, **ids)
        Qwen2_5_VLForConditionalGeneration._from_config(cfg).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "tokenizer")
    processor.image_processor.save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "model", tmp_path / "tokenizer"


def _data(tmp_path, n: int = 8) -> str:
    """`n` rows: an image filled with colour i % 4, the answer the digit i % 4 (balanced)."""
    rows = [{"data_source": "colours", "prompt": [{"role": "user", "content": "<image>which?"}],
             "images": [{"bytes": _png(COLOURS[i % 4]), "path": None}], "ability": "vision",
             "reward_model": {"style": "rule", "ground_truth": str(i % 4)}, "extra_info": {"index": i}}
            for i in range(n)]
    path = tmp_path / "colours.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def vl_keys(tmp_path, score: str, *, rows: int = 8, response_length: int = 4) -> list[str]:
    """The keys of a GRPO run of the tiny VL checkpoint on `rows` colour rows, scored by `return <score>` (of
    `solution_str` and `ground_truth`), one step, no validation."""
    model, tokenizer = _checkpoint(tmp_path)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    return {score}\n")
    return [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
            f"data.train_files={_data(tmp_path, n=rows)}", "data.val_files=null", "trainer.test_freq=-1",
            "data.max_prompt_length=64", f"data.max_response_length={response_length}",
            f"reward.custom_reward_function.path={reward}", "trainer.total_training_steps=1",
            "actor_rollout_ref.model.warm_start.steps=0"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe", "qwen3_5", "glm4v", "glm4v_moe"])
def test_grpo_on_image_prompts_runs_end_to_end(tmp_path, family):
    """Qwen2.5-VL, Qwen3-VL-MoE (its experts stacked on disk), Qwen3.5 as released (a vision-language checkpoint
    whose language model has hybrid layers), GLM-4.1V (its checkpoint layout: `lathe.models.glm4`) and GLM-4.5V
    (GLM-4.5's MoE layers): its checkpoint's Hugging Face weights are the same architecture again, vision tower
    included."""
    model, tokenizer = _checkpoint(tmp_path, family)
    data = _data(tmp_path)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str[:1] == ground_truth) + (sum(map(ord, solution_str)) % 3) / 4\n")
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
                  f"data.train_files={data}", f"data.val_files={data}", "data.max_prompt_length=64",
                  "data.max_response_length=4", f"reward.custom_reward_function.path={reward}",
                  "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false",
                  "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.model.warm_start.steps=0")
    metrics = read_metrics(tmp_path / "run")
    assert isinstance(trainer.worker.rollout.backend, LatheEngine) and trainer.worker.rollout.backend.vl
    assert sorted(metrics) == [1, 2] and metrics[2]["actor/grad_norm"] > 0
    assert metrics[2]["critic/score/max"] > metrics[2]["critic/score/min"]
    assert any(k.startswith("val-core/colours/") for k in metrics[2])
    start = _weights(model)
    moved = [k for k, p in trainer.worker.model.state_dict().items() if k.startswith("model.visual.")
             and not torch.equal(p.cpu(), start[k])]
    assert moved, "the update did not reach the vision tower"
    if family != "qwen2_5_vl":
        from transformers import AutoModelForImageTextToText
        if family == "qwen3_5":
            assert trainer.worker.rollout.backend.states is not None        # the linear layers' states beside the KV
        back, info = AutoModelForImageTextToText.from_pretrained(
            tmp_path / "run" / "global_step_2" / "actor" / "huggingface", output_loading_info=True)
        assert type(back).__name__ == json.loads((model / "config.json").read_text())["architectures"][0]
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert torch.equal(back.state_dict()["model.visual.patch_embed.proj.weight"],
                           trainer.worker.model.state_dict()["model.visual.patch_embed.proj.weight"].cpu())


def _weights(path):
    from lathe.models.vl import load_lathe_vl_model
    return {k: v.cpu() for k, v in load_lathe_vl_model(path).state_dict().items()}


def test_warm_start_of_a_vl_model_is_refused(tmp_path):
    model, tokenizer = _checkpoint(tmp_path)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(NotImplementedError, match="warm_start.steps=0"):
        run(tmp_path, f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
            f"reward.custom_reward_function.path={reward}",
            f"data.train_files={_data(tmp_path)}", "data.val_files=null", "trainer.test_freq=-1",
            "data.max_prompt_length=64")


def test_grpo_learns_to_read_the_image(tmp_path, monkeypatch):
    """GRPO from the random tiny model: the reward is 1 for the colour's digit first, 0.2 for another digit. A policy
    that ignores the image scores at most 0.4 (always the same digit: right for a quarter of the balanced rows), so
    a mean above that is read off the pixels, through the engine's image prompts and the trainer's image log-probs.
    (Here: 0.02 at the start, about 0.63 over steps 53-60. Within 60 steps: the run stops once its last 8 steps
    show both, tests/helpers.py stop_once_shown.)"""
    from helpers import stop_once_shown

    from . import test_ppo
    stop_once_shown(monkeypatch, lambda s: len(s) >= 16 and sum(s[-8:]) / 8 > 0.48
                    and sum(s[-8:]) / 8 > sum(s[:8]) / 8 + 0.3, also=[test_ppo])
    model, tokenizer = _checkpoint(tmp_path)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    c = solution_str[:1]\n    return 1.0 if c == ground_truth else (0.2 if c in '0123' else 0.0)\n")
    run(tmp_path, f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
        f"data.train_files={_data(tmp_path, n=64)}", "data.val_files=null", "trainer.test_freq=-1",
        "data.max_prompt_length=64", "data.max_response_length=2", f"reward.custom_reward_function.path={reward}",
        "trainer.total_training_steps=60", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.actor.optim.lr=3e-3", "actor_rollout_ref.model.warm_start.steps=0")
    scores = [m["critic/score/mean"] for _, m in sorted(read_metrics(tmp_path / "run").items())]
    first, last = sum(scores[:8]) / 8, sum(scores[-8:]) / 8
    assert last > 0.48 and last > first + 0.3, f"no learning from the image: {first:.2f} -> {last:.2f}"


def test_dynamic_batch_sizes_on_image_prompts_equal_fixed_micro_batches(tmp_path):
    """verl's token-budget micro-batches (`use_dynamic_bsz`, as the geo3k examples set it) on image rows: each
    micro-batch takes its own rows' images, and the step's losses and gradient norm equal fixed micro-batches'."""
    common = [*vl_keys(tmp_path, "float(solution_str[:1] == ground_truth) + (sum(map(ord, solution_str)) % 3) / 4"),
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]     # dynamic: several rows per micro-batch
    run(tmp_path, *common, name="fixed")
    run(tmp_path, *common, "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=80", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=80",
        name="dynamic")
    fixed, dynamic = read_metrics(tmp_path / "fixed")[1], read_metrics(tmp_path / "dynamic")[1]
    assert fixed["critic/score/mean"] == dynamic["critic/score/mean"]          # the same samples
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert abs(fixed[key] - dynamic[key]) <= 1e-4 * max(1.0, abs(fixed[key])), (key, fixed[key], dynamic[key])


def test_colocate_async_streams_image_prompts_as_the_synchronous_loop(tmp_path):
    """verl V1's colocate_async on image prompts: without warm-up batches each request's images reach the streamed
    engine with its prompt and the step is the synchronous loop's; with one, image samples generated a step ahead
    train under the newer weights."""
    common = [*vl_keys(tmp_path, "float(solution_str[:1] == ground_truth) + (sum(map(ord, solution_str)) % 3) / 4",
                       response_length=12), "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.total_training_steps=2",
              "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    run(tmp_path, *common, name="sync")
    run(tmp_path, *common, "trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=0",
        name="colocated")
    sync, colocated = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "colocated")
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            a, b = sync[step][key], colocated[step][key]
            assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), (step, key, a, b)
    run(tmp_path, *common, "trainer.v1.trainer_mode=colocate_async", "trainer.total_training_steps=3", name="ahead")
    ahead = read_metrics(tmp_path / "ahead")
    assert sorted(ahead) == [1, 2, 3] and all(r["actor/grad_norm"] == r["actor/grad_norm"] for r in ahead.values())
    # (image samples generated a step ahead, trained under newer weights; this load's samples all end together, so
    # none is interrupted: a continued image sample is not covered here)
    assert max(r["training/off_policy/trajectory_staleness_worst/max"] for r in ahead.values()) >= 1


def _text_keys(tmp_path) -> tuple[list[str], object]:
    """(keys, checkpoint directory) of a GRPO run of a tiny Qwen3.5 vision-language checkpoint on 8 text rows."""
    model, tokenizer = _checkpoint(tmp_path, "qwen3_5")
    rows = [{"data_source": "digits", "prompt": [{"role": "user", "content": f"say {i % 4}"}], "ability": "text",
             "reward_model": {"style": "rule", "ground_truth": str(i % 4)}, "extra_info": {"index": i}}
            for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "text.parquet")
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str[:1] == ground_truth) + (sum(map(ord, solution_str)) % 3) / 4\n")
    return [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
            f"data.train_files={tmp_path / 'text.parquet'}", "data.val_files=null", "trainer.test_freq=-1",
            "data.max_prompt_length=64", "data.max_response_length=6", f"reward.custom_reward_function.path={reward}",
            "actor_rollout_ref.model.warm_start.steps=0"], model


def _text_run(tmp_path, *keys):
    common, model = _text_keys(tmp_path)
    return run(tmp_path, *common, "trainer.total_training_steps=2", *keys), model


def test_text_grpo_on_a_qwen3_5_vision_language_checkpoint(tmp_path):
    """The common Qwen3.5 run: text prompts (math, code) on the released checkpoint, a vision-language model. With
    no image in the data its language model runs alone, as lathe's text decoder (everything a text model does:
    tensor, expert and sequence parallelism), and its engine generates (the n samples of a prompt fork from the
    first); the engine's log-probs are the trainer's; the checkpoint's Hugging Face weights are the whole
    vision-language model again: the trained language model and the vision tower as it was."""
    from transformers import Qwen3_5ForConditionalGeneration

    from lathe.models.decoder import LatheCausalLM
    trainer, model = _text_run(tmp_path, "actor_rollout_ref.actor.freeze_vision_tower=true")   # (it is, here)
    metrics = read_metrics(tmp_path / "run")
    actor = trainer.worker.model
    assert isinstance(actor, LatheCausalLM) and actor.config.linear_attention is not None
    engine = trainer.worker.rollout.backend
    assert isinstance(engine, LatheEngine) and engine.states is not None and engine.fork_samples
    assert metrics[2]["actor/grad_norm"] > 0 and metrics[2]["training/rollout_probs_diff_max"] < 1e-4
    back, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        tmp_path / "run" / "global_step_2" / "actor" / "huggingface", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    start, saved = _weights(model), back.state_dict()
    for name, p in start.items():
        if name.startswith("model.visual."):
            assert torch.equal(saved[name], p), name
    trained = {f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else k: p
               for k, p in actor.state_dict().items()}
    assert all(torch.equal(saved[k], p.cpu()) for k, p in trained.items())
    assert any(not torch.equal(saved[k], start[k]) for k in trained)


def test_text_grpo_on_a_qwen3_5_vision_language_checkpoint_with_tensor_parallel_training(tmp_path):
    """The same on 2 Ray CPU workers, the language model's layers cut over both (tensor parallelism, which lathe's
    VL model does not do): each worker loads the language model alone and rank 0 writes the whole checkpoint."""
    from transformers import Qwen3_5ForConditionalGeneration
    _text_run(tmp_path, "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2")
    metrics = read_metrics(tmp_path / "run")
    assert metrics[2]["actor/grad_norm"] > 0 and metrics[2]["training/rollout_probs_diff_max"] < 1e-4
    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(
        tmp_path / "run" / "global_step_2" / "actor" / "huggingface", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_text_run_of_a_qwen3_5_checkpoint_resumes_exactly(tmp_path, monkeypatch, lora):
    """A crash after the step-2 checkpoint (the whole vision-language model on disk, or a LoRA adapter named for it,
    which PEFT applies to that checkpoint) and a resume: steps 3 and 4 as the uninterrupted run's."""
    from .test_ppo import deterministic, run_crash_and_resume
    keys, model = _text_keys(tmp_path)
    keys += ["trainer.total_training_steps=4", "trainer.save_freq=2", "reward.timeout_s=0",
             "actor_rollout_ref.actor.optim.lr=1e-3"]
    if lora:
        keys += ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                 "actor_rollout_ref.model.target_modules=all-linear"]
    run_crash_and_resume(tmp_path, monkeypatch, keys)
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    for step in (3, 4):
        assert deterministic(a[step]) == deterministic(b[step]), step
    if lora:
        adapter = tmp_path / "split" / "global_step_4" / "actor" / "lora_adapter"
        from safetensors.torch import load_file
        names = list(load_file(adapter / "adapter_model.safetensors"))
        assert names and all(n.startswith("base_model.model.model.language_model.layers.") for n in names)
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        import peft
        from transformers import Qwen3_5ForConditionalGeneration

        from helpers import assert_close_rel
        base = Qwen3_5ForConditionalGeneration.from_pretrained(model).eval()
        with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
        merged = Qwen3_5ForConditionalGeneration.from_pretrained(adapter.parent / "huggingface").eval()
        ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
        with torch.no_grad():
            trained = merged(input_ids=ids).logits
            assert_close_rel(with_adapter(input_ids=ids).logits, trained, 1e-5,
                             name="PEFT's adapter on the checkpoint vs lathe's merged save")
            start = Qwen3_5ForConditionalGeneration.from_pretrained(model).eval()(input_ids=ids).logits
        assert float((trained - start).abs().max()) > 1e-4, "the adapter changed nothing: the test would not tell"


def test_ppo_critic_from_a_qwen3_5_vision_language_checkpoint(tmp_path):
    """verl's PPO with a critic initialised from the actor's Qwen3.5 checkpoint: its language model is lathe's value
    model (a zero `score` head; not transformers' token-classification model, whose linear attention falls back to
    torch's reference code), and the critic's checkpoint is transformers' token-classification form of the whole
    model, vision tower included."""
    from transformers import AutoModelForTokenClassification

    from lathe.models.decoder import LatheValueModel
    keys, model = _text_keys(tmp_path)
    trainer = run(tmp_path, *keys, "trainer.total_training_steps=2", "algorithm.adv_estimator=gae",
                  f"critic.model.path={model}")
    assert isinstance(trainer.critic.model, LatheValueModel)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[2]["critic/vf_loss"] > 0 and metrics[1]["critic/values/mean"] == 0.0     # the zero head's
    back, info = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "run" / "global_step_2" / "critic" / "huggingface", output_loading_info=True)
    assert type(back).__name__ == "Qwen3_5ForTokenClassification"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = trainer.critic.model.state_dict()
    assert torch.equal(back.state_dict()["score.weight"], trained["score.weight"].cpu())


def test_sft_of_a_qwen3_5_vision_language_checkpoint_saves_the_whole_model(tmp_path):
    """`lathe sft` (text examples) on Qwen3.5 as released: its language model trains alone, and the checkpoint
    `lathe train` starts from is the whole vision-language model."""
    from transformers import AutoModelForImageTextToText

    from lathe.cli import main
    model, tokenizer = _checkpoint(tmp_path, "qwen3_5")
    assert main(["sft", f"trainer.default_local_dir={tmp_path / 'sft'}", f"model.path={model}",
                 f"model.tokenizer_path={tokenizer}", "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4",
                 "data.val_files=null", "trainer.logger=[console]", "trainer.total_training_steps=2"]) == 0
    back, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "sft" / "global_step_2" / "actor" / "huggingface", output_loading_info=True)
    assert type(back).__name__ == "Qwen3_5ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


FSDP = "actor_rollout_ref.actor.fsdp_config"


@pytest.mark.parametrize("family,parallel,common", [
    ("qwen3_5_moe", [f"{FSDP}.expert_parallel_size=2"], []),
    ("qwen3_5", [f"{FSDP}.tensor_parallel_size=2"], ["actor_rollout_ref.actor.use_kl_loss=true"]),
    ("qwen3_vl_moe", [f"{FSDP}.tensor_parallel_size=2", f"{FSDP}.expert_parallel_size=2"], []),
    ("qwen3_5_moe", ["actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.expert_parallel_size=2"], []),
    ("qwen3_vl_moe", ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     ["actor_rollout_ref.model.use_remove_padding=true"]),
], ids=["qwen3_5_moe-ep2", "qwen3_5-tp2-kl", "qwen3_vl_moe-tp2-ep2", "qwen3_5_moe-rollout-tp2", "qwen3_vl_moe-sp2"])
def test_model_parallel_image_runs_equal_one_process(tmp_path, monkeypatch, family, parallel, common):
    """Image rows on 2 Ray CPU workers under FSDP2, the VL model's language model cut over both: experts (Qwen3.5-MoE:
    hybrid layers, routed and shared experts), tensor parallelism (Qwen3.5's gated DeltaNet and gated attention; the
    reference cut too, for the KL loss), both (Qwen3-VL-MoE, deepstack); or the engine a tensor-parallel replica over
    both (its experts placed over it); or Ulysses, each rank a slice of the packed stream (its deepstack rows too);
    the vision tower whole on each. Step 2's loss, gradient norm and entropy (after a weight sync) are one
    process's."""
    from . import test_vl_train
    plain = _checkpoint
    monkeypatch.setattr(test_vl_train, "_checkpoint", lambda path, family_="qwen2_5_vl": plain(path, family))
    keys = vl_keys(tmp_path, "float(solution_str[:1] == ground_truth) + (sum(map(ord, solution_str)) % 3) / 4")
    out = {}
    for name, extra in (("one", []), ("many", ["trainer.n_gpus_per_node=2", *parallel])):
        run(tmp_path, *keys, "trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.lr=1e-3", *common,
            *extra, name=name)
        out[name] = read_metrics(tmp_path / name)[2]
    assert out["one"]["critic/score/mean"] == out["many"]["critic/score/mean"]          # the same samples
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert abs(out["one"][key] - out["many"][key]) <= 1e-5 * max(1.0, abs(out["one"][key])), key


def test_a_hub_id_of_a_vision_language_checkpoint_loads_as_one(tmp_path, monkeypatch):
    """verl's scripts name models by hub id (`Qwen/Qwen3.5-4B`, `Qwen/Qwen3-VL-8B-Instruct`): such an id is read from
    the hub's local cache (downloaded there first when online) and recognised as a vision-language checkpoint, here
    offline from a cache holding a tiny Qwen3.5: its language model runs alone and the save is the whole model (the
    transformers fallback hub ids took read it as a text model and saved it without its vision tower)."""
    from lathe.models import hf
    from models.test_hf import _fake_hub
    keys, model = _text_keys(tmp_path)
    _fake_hub(tmp_path, monkeypatch, "tiny/qwen35", model)
    keys = [k for k in keys if not k.startswith("actor_rollout_ref.model.path=")]
    trainer = run(tmp_path, *keys, "actor_rollout_ref.model.path=tiny/qwen35", "trainer.total_training_steps=1")
    hf.checkpoint_config_dir.cache_clear()
    assert trainer.worker.model.config.vl_checkpoint is not None
    config = json.loads((tmp_path / "run" / "global_step_1" / "actor" / "huggingface" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
