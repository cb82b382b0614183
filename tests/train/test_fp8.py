"""Tests for lathe.train.fp8 (the actor's `fsdp_config.fp8_training`): which layers become FP8, an update under FP8
stays close to the bf16/fp32 one, checkpoints and weight sync stay plain, and what is refused says which key.

On CPUs torchao's float8 runs emulated (float8 casts, high-precision products; `fp8.emulated()`, tests only); the
real FP8 products run in the GPU test."""

import warnings

import pytest
import torch
from torch import nn

from lathe.config import ConfigError, load_config
from lathe.data.builtin import builtin_tokenizer
from lathe.models.decoder import init_weights
from lathe.models.hf import build_builtin_model
from lathe.train import fp8
from lathe.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import plan_of, worker_ppo_batch

from .test_parallel import run_ranks, tiny_model, train

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'lathe[fp8]')")

KEY = "actor_rollout_ref.actor.fsdp_config.fp8_training"
OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config"


def _worker(load_cfg, *overrides, device="cpu", model=None):
    cfg = load_cfg("actor_rollout_ref.model.path=builtin:tiny", "actor_rollout_ref.model.use_remove_padding=true",
                   "actor_rollout_ref.rollout.name=lathe", *overrides)
    tok = builtin_tokenizer()
    model = model() if model is not None else build_builtin_model("tiny", vocab_size=len(tok), seed=0)
    return ActorRolloutRefWorker(cfg, model, tok, plan=plan_of(cfg, needs_ref=True), total_steps=10,
                                 device=torch.device(device))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_the_decoder_projections_convert_and_the_rest_stays(make_lathe):
    model = make_lathe()
    assert fp8.targets(model) == []           # too small for FP8 to pay (torchao's thresholds), but emulated: every size
    with fp8.emulated():
        names = fp8.targets(model)
        assert len(names) == 2 * 7 and all(n.startswith("model.layers.") for n in names)   # q/k/v/o, gate/up/down
        model.model.layers[0].mlp.down_proj = nn.Linear(64, 24, bias=False)    # 24: not a multiple of 16
        assert "model.layers.0.mlp.down_proj" not in fp8.targets(model)
        before = {k: v for k, v in model.state_dict().items()}
        fp8.convert(model, "tensorwise")
    assert type(model.model.layers[1].self_attn.q_proj).__name__ == "Float8Linear"
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.down_proj) is nn.Linear
    after = model.state_dict()      # the same names, the same (plain) tensors
    assert list(after) == list(before) and all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in after)
    assert all(type(t) is torch.Tensor for t in after.values())


@pytest.mark.parametrize("recipe,extra", [("tensorwise", ()), ("rowwise", ()), ("rowwise_with_gw_hp", ()),
                                          ("tensorwise", ("actor_rollout_ref.model.enable_gradient_checkpointing=true",))])
def test_an_fp8_update_stays_close_to_the_full_precision_one(load_cfg, rollout_batch, recipe, extra):
    """The same batch, the same starting weights: the loss and the gradient norm of the emulated FP8 update are
    within a few percent of the fp32 one (e4m3 keeps 3 mantissa bits: ~3% per element, averaged over products);
    gradient checkpointing recomputes the FP8 layers alike."""
    ref_worker = _worker(load_cfg)
    batch = worker_ppo_batch(ref_worker, rollout_batch)
    start = {k: t.clone() for k, t in ref_worker.model.state_dict().items()}
    ref = ref_worker.update_actor(batch)
    with fp8.emulated():
        worker = _worker(load_cfg, f"{KEY}={recipe}", *extra)
        assert fp8.is_converted(worker.model) and not fp8.is_converted(worker.ref.model)
        out = worker.update_actor(batch)
    assert _rel(out["actor/pg_loss"], ref["actor/pg_loss"]) < 0.05, (out["actor/pg_loss"], ref["actor/pg_loss"])
    assert _rel(out["actor/grad_norm"], ref["actor/grad_norm"]) < 0.05, (out["actor/grad_norm"], ref["actor/grad_norm"])
    # the whole update, as one vector, in about the same direction
    fp8_step, ref_step = ([(t.detach() - start[k]).flatten() for k, t in w.model.state_dict().items()]
                          for w in (worker, ref_worker))
    fp8_step, ref_step = torch.cat(fp8_step), torch.cat(ref_step)
    # AdamW's first step is about lr x sign(gradient): elements whose gradient is near 0 may flip, hence a loose bound
    assert float(torch.cosine_similarity(fp8_step, ref_step, 0)) > 0.9


def test_a_checkpoint_saved_under_fp8_loads_without_it_and_the_rollout_gets_plain_weights(load_cfg, rollout_batch,
                                                                                        tmp_path):
    with fp8.emulated():
        worker = _worker(load_cfg, f"{KEY}=tensorwise")
        worker.update_actor(worker_ppo_batch(worker, rollout_batch))
        worker.sync_weights()
        worker.save_checkpoint(tmp_path / "actor")
    engine = worker.rollout.backend.model
    assert not fp8.is_converted(engine)
    assert all(torch.equal(t, engine.state_dict()[k]) for k, t in worker.model.state_dict().items())
    plain = _worker(load_cfg)
    plain.load_checkpoint(tmp_path / "actor")
    assert all(torch.equal(t, plain.model.state_dict()[k]) for k, t in worker.model.state_dict().items())


def test_a_frozen_copy_of_a_transformers_module_computes_with_plain_linear_layers(make_model):
    from lathe.models.frozen import frozen_copy
    model = make_model()
    with fp8.emulated():
        fp8.convert(model, "tensorwise")
    copy = frozen_copy(model, torch.float32, torch.device("cpu"))
    assert fp8.is_converted(model) and not fp8.is_converted(copy)
    assert all(torch.equal(t, copy.state_dict()[k]) for k, t in model.state_dict().items())


def test_transformers_generate_on_the_actors_own_module_is_refused(load_cfg):
    with fp8.emulated(), pytest.raises(ValueError, match=f"{KEY}=tensorwise: transformers' generate would share"):
        _worker(load_cfg, f"{KEY}=tensorwise", "actor_rollout_ref.model.impl=hf", "actor_rollout_ref.rollout.name=hf")


def fp8_train(world: int, **job):
    """`test_parallel.train` with FP8 training emulated (a rank's module-level body)."""
    with fp8.emulated():
        return train(world, **job)


def hf_init_model() -> torch.nn.Module:
    """`test_parallel.tiny_model` 64 wide, initialised as Hugging Face does (std 0.02): at its std of 0.2 the logits
    are so large that FP8's rounding moves the loss by ~10%, more than a real model's."""
    model = tiny_model(hidden_size=64, intermediate_size=128)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        init_weights(model, std=0.02)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_fsdp2_on_two_gloo_ranks_trains_close_to_one_process_and_saves_plain_weights(tmp_path, recipe):
    """FSDP2 gathers the fp32 (bf16 on a GPU) shards and each forward casts them (no float8 all-gather): 2 ranks
    under FP8 update close to one process without it, the full state and the rollout's weights are plain tensors,
    and the sharded checkpoint they write resumes in one process without FP8 (or torchao)."""
    job = dict(fsdp_size=-1, steps=range(2), engine=True, overrides=(f"{KEY}={recipe}",), model_fn=hf_init_model,
               save=tmp_path / "ckpt")
    (sharded, _), = run_ranks(2, tmp_path / "ranks", job, fn=fp8_train)
    one = train(1, -1, steps=range(2), model_fn=hf_init_model)
    resumed = train(1, -1, steps=range(0), model_fn=hf_init_model, resume=tmp_path / "ckpt")
    assert all(torch.equal(t, resumed["weights"][k]) for k, t in sharded["weights"].items())
    for got, want in zip(sharded["metrics"], one["metrics"]):
        for key in ("actor/pg_loss", "actor/grad_norm"):
            assert _rel(got[key], want[key]) < 0.05, (key, got[key], want[key])
    assert set(sharded["weights"]) == set(one["weights"])
    assert all(type(t) is torch.Tensor for t in [*sharded["weights"].values(), *sharded["engine"].values()])


def test_fp8_pays_from_torchaos_sizes_on():
    """Qwen2.5-7B (hidden 3584, k/v 512, MLP 18944) under tensorwise scaling: all but the k/v projections."""
    assert fp8.pays("tensorwise", 3584, 3584) and fp8.pays("tensorwise", 18944, 3584)
    assert not fp8.pays("tensorwise", 512, 3584) and fp8.pays("tensorwise", 3584, 18944)
    assert not fp8.pays("rowwise", 1536, 8960) and fp8.pays("rowwise", 8960, 1536)
    assert fp8.pays("rowwise_with_gw_hp", 1536, 8960) and not fp8.pays("rowwise_with_gw_hp", 256, 1536)


def test_the_device_check_fails_up_front_outside_emulation():
    with pytest.raises(ValueError, match=f"{KEY}=tensorwise: FP8 training needs an NVIDIA GPU of compute capability "
                                         "8.9"):
        fp8.check_device("tensorwise", torch.device("cpu"))
    fp8.check_device(None, torch.device("cpu"))            # off: nothing to check


def _load(*overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config("base", list(overrides))


def _refused(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        _load(*overrides)
    return str(err.value)


def test_config_megatron_hybrid_translates_and_rollout_correction_turns_on():
    cfg = _load(f"{OTC}.fp8=hybrid", f"{OTC}.fp8_recipe=tensorwise", f"{OTC}.fp8_amax_history_len=16")
    assert cfg.actor_rollout_ref.actor.fsdp_config.fp8_training == "tensorwise"
    assert cfg.algorithm.rollout_correction.rollout_is == "token"       # the precisions differ: token TIS
    off = _load(f"{KEY}=rowwise", "actor_rollout_ref.rollout.quantization_correction=false")
    assert off.algorithm.rollout_correction.rollout_is is None
    assert _load().algorithm.rollout_correction.rollout_is is None


def test_config_refusals_name_the_key():
    assert "set it to hybrid" in _refused(f"{OTC}.fp8=e4m3")
    assert "fp8_recipe`=blockwise" in _refused(f"{OTC}.fp8=hybrid", f"{OTC}.fp8_recipe=blockwise")
    assert "fp8_recipe`=mxfp8" in _refused(f"{OTC}.fp8=hybrid", f"{OTC}.fp8_recipe=mxfp8")
    assert "fp8_param`=true" in _refused(f"{OTC}.fp8=hybrid", f"{OTC}.fp8_param=true")
    assert "critic.megatron.override_transformer_config.fp8" in _refused(
        "+critic.megatron.override_transformer_config.fp8=hybrid")
    assert f"{KEY}=tensorwise with actor_rollout_ref.model.lora_rank=8" in _refused(
        f"{KEY}=tensorwise", "actor_rollout_ref.model.lora_rank=8")
    assert f"{KEY}=tensorwise with actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2" in _refused(
        f"{KEY}=tensorwise", "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2",
        "trainer.n_gpus_per_node=2")


def _wide_model():
    """Two Qwen2 layers wide enough for FP8 to pay (`fp8.pays`) in all but the k/v projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tok = builtin_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_fp8_update_on_a_gpu(load_cfg, rollout_batch, recipe):
    """The real FP8 products (torch._scaled_mm, the decoder layers compiled) on an FP8 GPU under bf16 mixed
    precision: close to the bf16 update, and the engine receives the plain bf16 weights."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an NVIDIA GPU of compute capability 8.9 or later")
    gpu = ("actor_rollout_ref.rollout.gpu_memory_utilization=0.2", "data.max_prompt_length=24",
           "data.max_response_length=12")
    ref_worker = _worker(load_cfg, *gpu, device="cuda", model=_wide_model)
    batch = worker_ppo_batch(ref_worker, rollout_batch)
    ref = ref_worker.update_actor(batch)
    worker = _worker(load_cfg, *gpu, f"{KEY}={recipe}", device="cuda", model=_wide_model)
    assert fp8.is_converted(worker.model) and not fp8.is_converted(worker.rollout.backend.model)
    assert len(fp8.targets(worker.ref.model)) == 2 * 5     # q, o, gate, up, down (k/v too small to pay)
    out = worker.update_actor(batch)
    assert _rel(out["actor/pg_loss"], ref["actor/pg_loss"]) < 0.1, (out["actor/pg_loss"], ref["actor/pg_loss"])
    assert _rel(out["actor/grad_norm"], ref["actor/grad_norm"]) < 0.1, (out["actor/grad_norm"], ref["actor/grad_norm"])
    worker.sync_weights()
    engine = worker.rollout.backend.model.state_dict()
    assert all(torch.equal(t, engine[k]) for k, t in worker.model.state_dict().items() if k in engine)
