"""End-to-end runs of the GRPO driver on the built-in task: resume equality, failing rewards, GSM8K."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lathe.config import load_config
from lathe.loop import ppo
from lathe.loop.run import fit        # (`lathe train`'s driver: the config's mode picks the loop)
from lathe.loop.oom import OutOfMemory
from lathe.loop.setup import build_trainer
from lathe.reward.manager import RewardFunctionFailing

from helpers import warm_started

SHARED_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"

TINY = [
    "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=4",
    "data.val_batch_size=64", "trainer.logger=[console]",
]


def tiny(overrides=()) -> list[str]:
    """TINY on the built-in model warm-started for 100 steps, unless the overrides choose the model or its warm
    start themselves."""
    own = any(o.startswith(("actor_rollout_ref.model.path=", "actor_rollout_ref.model.warm_start.")) for o in overrides)
    return [*TINY, *([] if own else warm_started(100))]


def run(tmp_path: Path, *overrides: str, name: str = "run"):
    cfg = load_config(None, [*tiny(overrides), f"trainer.default_local_dir={tmp_path / name}", *overrides])
    trainer = build_trainer(cfg)
    try:
        fit(trainer)
    finally:
        trainer.close()
    return trainer


def read_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def save_with_builtin_tokenizer(model, path: Path) -> Path:
    """`model` (a transformers causal LM over the built-in tokenizer's vocabulary) and that tokenizer, saved at
    `path`: a checkpoint `lathe train` starts from."""
    from lathe.data.builtin import builtin_tokenizer
    model.save_pretrained(path)
    builtin_tokenizer().save_pretrained(path)
    return path


def qwen3_moe_checkpoint(path: Path, kv_heads: int = 1) -> Path:
    """A tiny random Qwen3-MoE (2 layers, the second sparse: 4 experts, top-2) with the built-in tokenizer; `kv_heads`
    2 for a model that tensor parallelism of 2 cuts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    torch.manual_seed(0)
    return save_with_builtin_tokenizer(Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=kv_heads, head_dim=16, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)), path)


def steps_from(tmp_path: Path, model_path: Path, *overrides: str, steps: int = 2):
    """`lathe train` from the checkpoint at `model_path` for `steps` steps (no warm start, no validation), into
    tmp_path/run: (trainer, metrics by step)."""
    trainer = run(tmp_path, f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.model.warm_start.steps=0",
                  f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  *overrides)
    return trainer, read_metrics(tmp_path / "run")


def reads_back(cls, run_dir: Path, step: int = 2) -> bool:
    """Whether transformers' `cls` loads the step's saved Hugging Face copy with no missing or unexpected key."""
    _, info = cls.from_pretrained(run_dir / f"global_step_{step}" / "actor" / "huggingface", output_loading_info=True)
    return not info["missing_keys"] and not info["unexpected_keys"]


def deterministic(metrics: dict) -> dict:
    """Everything but wall-clock figures."""
    return {k: v for k, v in metrics.items() if not k.startswith(("timing", "perf/"))}


def run_crash_and_resume(tmp_path: Path, monkeypatch, overrides: list[str]):
    """(uninterrupted trainer, resumed trainer): runs "whole", then "split" crashing at step 3 and resumed
    from its step-2 checkpoint (overrides must set trainer.save_freq=2)."""
    whole = run(tmp_path, *overrides, name="whole")
    real_step = ppo.train_step

    def crash_at_step_3(t, prompts):
        if t.global_step == 3:
            raise KeyboardInterrupt("simulated crash")
        return real_step(t, prompts)

    monkeypatch.setattr(ppo, "train_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, *overrides, name="split")
    monkeypatch.setattr(ppo, "train_step", real_step)
    resumed = run(tmp_path, *overrides, name="split")
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "global_step_2"
    return whole, resumed


def test_resume_matches_uninterrupted_run(tmp_path, monkeypatch):
    # in-process scoring: a scorer timeout under heavy machine load would change a score, which is not what
    # this test is about (timeouts have their own tests)
    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2", "reward.timeout_s=0",
              "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.ppo_epochs=2",
              "actor_rollout_ref.actor.shuffle=true",          # each epoch's order drawn again after the resume
              "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr=3e-4"]
    whole, resumed = run_crash_and_resume(tmp_path, monkeypatch, common)
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        assert 0 < a[step]["critic/score/mean"] < 1, "no reward signal: the test would not exercise the update"
        assert a[step]["actor/grad_norm"] > 0
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    assert "actor/kl_loss" in a[4] and a[4]["actor/kl_loss"] != 0.0
    assert a[4]["rollout/num_preemptions"] == 0 and a[4]["rollout/kv_cache_blocks"] > 0, "the engine's own metrics"
    assert a[4]["rollout/kv_cache_gb"] > 0 and a[4]["rollout/graph_captures"] == 0 and "timing_s/update_weights" in a[4]
    for (name, p), q in zip(whole.worker.model.named_parameters(), resumed.worker.model.parameters()):
        assert torch.equal(p, q), name


def test_sgd_actor_and_adam_critic_train_and_resume_exactly(tmp_path, monkeypatch):
    """verl's optimizer keys act in `lathe train`: the actor steps with SGD (momentum from override_optimizer_config),
    the critic with Adam, and a run resumed from its step-2 checkpoint takes the same steps 3 and 4."""
    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1", "reward.timeout_s=0",
              "trainer.val_before_train=false", "algorithm.adv_estimator=gae",
              "actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=1e-3",
              "+actor_rollout_ref.actor.optim.override_optimizer_config.momentum=0.9", "critic.optim.optimizer=Adam"]
    whole, resumed = run_crash_and_resume(tmp_path, monkeypatch, common)
    assert type(whole.worker.actor.optimizer) is torch.optim.SGD and type(whole.critic.optimizer) is torch.optim.Adam
    assert whole.worker.actor.optimizer.param_groups[0]["momentum"] == 0.9
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    for step in (3, 4):
        assert a[step]["actor/grad_norm"] > 0 and a[step]["critic/grad_norm"] > 0
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    for (name, p), q in zip(whole.worker.model.named_parameters(), resumed.worker.model.parameters()):
        assert torch.equal(p, q), name


def test_a_lora_critic_trains_its_adapters_and_head_and_resumes_exactly(tmp_path, monkeypatch):
    """`critic.model.lora_rank` acts in `lathe train`: the critic's checkpoint holds its adapter and head, and a run
    resumed from its step-2 checkpoint takes the same steps 3 and 4."""
    common = ["trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1", "reward.timeout_s=0",
              "trainer.val_before_train=false", "algorithm.adv_estimator=gae", "critic.model.lora_rank=8",
              "critic.model.lora_alpha=16", "critic.optim.lr=1e-3"]
    whole, resumed = run_crash_and_resume(tmp_path, monkeypatch, common)
    assert (tmp_path / "split" / "global_step_2" / "critic" / "lora_adapter" / "adapter_config.json").exists()
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    for step in (3, 4):
        assert a[step]["critic/grad_norm"] > 0
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    trained = {n for n, p in whole.critic.model.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and all(n.startswith("score.") or ".lora_" in n for n in trained)
    for (name, p), q in zip(whole.critic.model.named_parameters(), resumed.critic.model.parameters()):
        assert torch.equal(p, q), name


def test_an_optimizer_argument_the_class_rejects_stops_the_run_before_a_model_loads(tmp_path, monkeypatch):
    from lathe.config import ConfigError
    from lathe.loop import setup

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the optimizer was checked")
    monkeypatch.setattr(setup, "build_model", no_model)
    cfg = load_config(None, [*tiny(()), f"trainer.default_local_dir={tmp_path}",
                             "actor_rollout_ref.actor.optim.optimizer=SGD",
                             "+actor_rollout_ref.actor.optim.override_optimizer_config.momentun=0.9"])
    with pytest.raises(ConfigError, match=r"`actor_rollout_ref.actor.optim.override_optimizer_config`=.*momentun.* "
                                          r"Fix: remove momentun"):
        build_trainer(cfg)


def test_validation_does_not_change_training(tmp_path):
    with_val = run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=1", name="val")
    without = run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                  "trainer.val_before_train=false", name="noval")
    a, b = read_metrics(tmp_path / "val"), read_metrics(tmp_path / "noval")
    assert any(k.startswith("val-core/lathe/arithmetic/reward/mean@1") for k in a[2])
    assert a[2]["critic/score/mean"] == b[2]["critic/score/mean"]
    for p, q in zip(with_val.worker.model.parameters(), without.worker.model.parameters()):
        assert torch.equal(p, q)


def test_failing_and_hanging_reward_does_not_stop_the_run(tmp_path, caplog):
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['index'] % 3 == 0:\n"
        "        raise RuntimeError('scorer exploded')\n"
        "    if extra_info['index'] % 7 == 1:\n"
        "        time.sleep(60)\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'len': len(solution_str)}\n")
    trainer = run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                  "trainer.val_before_train=false", "reward.timeout_s=0.5",
                  f"reward.custom_reward_function.path={reward_file}", "data.shuffle=false")
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2
    errors = sum(m.get("reward/num_errors", 0) for m in metrics.values())
    timeouts = sum(m.get("reward/num_timeouts", 0) for m in metrics.values())
    assert errors > 0 and timeouts > 0
    assert "reward_extra/len/mean" in metrics[1]
    assert "scorer exploded" in caplog.text


def test_a_prewarmed_model_trains_as_a_run_that_warm_starts_it_itself(tmp_path):
    """What lets the suite share one warm start (tests/helpers.py warm_started): the RL steps after it are the same."""
    steps = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    own = run(tmp_path, *steps, "actor_rollout_ref.model.warm_start.steps=100", name="own")
    shared = run(tmp_path, *steps, name="shared")
    assert (tmp_path / "own" / "init_model").exists() and not (tmp_path / "shared" / "init_model").exists()
    a, b = read_metrics(tmp_path / "own"), read_metrics(tmp_path / "shared")
    assert sorted(a) == [1, 2] and all(deterministic(a[s]) == deterministic(b[s]) for s in a)
    assert own.global_step == shared.global_step == 2


@pytest.mark.parametrize("method,phase,key", [("update_actor", "update_actor", "ppo_micro_batch_size_per_gpu"),
                                              ("generate_sequences", "gen", "gpu_memory_utilization")])
def test_out_of_memory_names_the_phase_and_the_keys(tmp_path, monkeypatch, method, phase, key):
    cfg = load_config(None, [*tiny(), f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=1",
                             "trainer.test_freq=-1", "trainer.val_before_train=false"])
    trainer = build_trainer(cfg)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.1 GiB in use.")

    monkeypatch.setattr(trainer.worker, method, oom)
    try:
        with pytest.raises(OutOfMemory, match=f"during {phase}: CUDA out of memory. Tried to allocate 2.00 GiB") as err:
            fit(trainer)
    finally:
        trainer.close()
    assert key in str(err.value)


@pytest.mark.parametrize("overrides,forward", [
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], False),            # one epoch over one mini-batch
    (["actor_rollout_ref.actor.ppo_mini_batch_size=2"], True),             # two mini-batches: the second is off-policy
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_epochs=2"], True),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.use_kl_in_reward=true"], True),   # reads them
    # IS weights alone the on-policy update computes from its own forward; rejection and batch-normalised weights
    # need pi_old before it starts
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.rollout_correction.rollout_is=token"], False),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.rollout_correction.rollout_is=token",
      "algorithm.rollout_correction.rollout_is_batch_normalize=true"], True),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.rollout_correction.rollout_rs=token_k1",
      "algorithm.rollout_correction.rollout_rs_threshold=2.0"], True),
    # LoRA dropout: the update's forward is not the old policy's dropout-free pass, which the weights then need
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4", "algorithm.rollout_correction.rollout_is=token",
      "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_dropout=0.1"], True),
])
def test_the_old_policy_forward_runs_only_when_something_reads_it(tmp_path, monkeypatch, overrides, forward):
    cfg = load_config(None, [*tiny(), f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=2",
                             "trainer.test_freq=-1", "trainer.val_before_train=false", *overrides])
    trainer = build_trainer(cfg)
    calls = []
    real = trainer.worker.compute_log_prob
    monkeypatch.setattr(trainer.worker, "compute_log_prob", lambda batch: calls.append(1) or real(batch))
    try:
        fit(trainer)
    finally:
        trainer.close()
    metrics = read_metrics(tmp_path)
    assert len(calls) == (2 if forward else 0)
    assert all(("timing_s/old_log_prob" in m) == forward for m in metrics.values())
    assert all(m["training/old_log_prob_forward"] == float(forward) and m["training/old_log_prob_from_rollout"] == 0
               for m in metrics.values())                                  # the metrics say which happened
    # the engine-vs-trainer check is there either way (the update computes it when it takes pi_old's log-probs)
    assert all(0 <= m["training/rollout_probs_diff_max"] < 0.05 for m in metrics.values()), metrics
    if any("rollout_correction" in o for o in overrides):      # and the correction's metrics, whoever computed them
        assert all("rollout_corr/kl" in m for m in metrics.values())


def test_an_update_that_leaves_out_the_correction_left_to_it_stops_the_run(tmp_path, monkeypatch):
    """On-policy with token TIS the loop skips the old-policy pass and leaves the correction to the update: an update
    that comes back without its `rollout_corr/*` metrics (a worker built without the correction's keys) stops the
    step rather than training uncorrected."""
    cfg = load_config(None, [*tiny(), f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=1",
                             "trainer.test_freq=-1", "trainer.val_before_train=false",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                             "algorithm.rollout_correction.rollout_is=token"])
    trainer = build_trainer(cfg)
    real = trainer.worker.update_actor
    monkeypatch.setattr(trainer.worker, "update_actor", lambda batch: {
        k: v for k, v in real(batch).items() if not k.startswith("rollout_corr/")})
    try:
        with pytest.raises(RuntimeError, match="computed no rollout correction"):
            fit(trainer)
    finally:
        trainer.close()


def test_a_reward_function_failing_on_every_sample_stops_the_run(tmp_path):
    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return extra_info['no_such_field']\n")
    with pytest.raises(RewardFunctionFailing, match="KeyError: 'no_such_field'"):
        run(tmp_path, "trainer.total_training_steps=6", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "reward.timeout_s=0", f"reward.custom_reward_function.path={reward_file}")
    assert len(read_metrics(tmp_path / "run")) == 2       # steps 1 and 2 logged; step 3's scoring stopped it


@pytest.mark.skipif(not SHARED_GSM8K.exists(), reason="GSM8K not found at ../shared/data/gsm8k")
def test_gsm8k_steps_with_a_transformers_checkpoint(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lathe.data.builtin import builtin_tokenizer
    from lathe.data.preprocess import PREPROCESSORS

    out = PREPROCESSORS["gsm8k"](str(SHARED_GSM8K), str(tmp_path / "gsm8k"))
    tok = builtin_tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    trainer = run(tmp_path, f"data.train_files={out['train']}", f"data.val_files={out['test']}",
                  f"actor_rollout_ref.model.path={tmp_path / 'model'}", "actor_rollout_ref.model.warm_start.steps=0",
                  "data.max_prompt_length=300", "data.filter_overlong_prompts=true", "data.max_response_length=8",
                  "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false")
    metrics = read_metrics(tmp_path / "run")
    assert trainer.global_step == 2 and trainer.loader.dataset.num_filtered > 0
    assert metrics[2]["response_length/clip_ratio"] >= 0 and "critic/score/mean" in metrics[2]
    assert metrics[2]["prompt_length/max"] <= 300


@pytest.mark.parametrize("aux", ["", "transformers", "megatron"], ids=["plain", "router_aux_loss", "megatron"])
def test_steps_with_a_qwen3_moe_checkpoint(tmp_path, aux):
    """A tiny Qwen3-MoE checkpoint trains on lathe's decoder and engine; `output_router_logits` (through
    override_config) adds the routers' load-balancing loss, reported as actor/router_aux_loss; Megatron's
    coefficients (verl's keys) add its switch loss and z-loss, reported as actor/load_balancing_loss and
    actor/z_loss."""
    from transformers import Qwen3MoeForCausalLM

    from lathe.models.moe import SparseMoeBlock
    model = qwen3_moe_checkpoint(tmp_path / "model")
    otc = "+actor_rollout_ref.actor.megatron.override_transformer_config"
    extra = {"": [], "transformers": ["+actor_rollout_ref.model.override_config.output_router_logits=true",
                                      "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.5"],
             "megatron": [f"{otc}.moe_aux_loss_coeff=0.5", f"{otc}.moe_z_loss_coeff=0.01"]}[aux]
    trainer, metrics = steps_from(tmp_path, model, *extra)
    assert any(isinstance(m, SparseMoeBlock) for m in trainer.worker.model.modules())
    assert trainer.global_step == 2 and torch.isfinite(torch.tensor(metrics[2]["actor/pg_loss"]))
    assert ("actor/router_aux_loss" in metrics[2]) == (aux == "transformers")
    assert ("actor/load_balancing_loss" in metrics[2]) == ("actor/z_loss" in metrics[2]) == (aux == "megatron")
    if aux == "transformers":
        assert 1.0 <= metrics[2]["actor/router_aux_loss"] < 4.0     # E * sum f P: 2 = k when balanced, at most k E / 2
    if aux == "megatron":                                            # f normalised by k: 1 when balanced, at most E / k
        assert 0.5 <= metrics[2]["actor/load_balancing_loss"] <= 2.0 and metrics[2]["actor/z_loss"] > 0
    assert reads_back(Qwen3MoeForCausalLM, tmp_path / "run")            # the checkpoint saved reads back
    if not aux:                                                          # and lathe resumes from it
        trainer, metrics = steps_from(tmp_path, model, steps=3)
        assert trainer.global_step == 3 and 3 in metrics


def test_global_profiler_writes_the_listed_steps_phases(tmp_path):
    prof = tmp_path / "prof"
    run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "global_profiler.tool=torch", "global_profiler.steps=[2]", f"global_profiler.save_path={prof}")
    assert sorted(p.name for p in prof.iterdir()) == ["step_2"]
    summary = json.loads((prof / "step_2" / "summary.json").read_text())
    assert {"gen", "reward", "adv", "update_actor", "update_weights"} <= set(summary["phases"])
    update = summary["phases"]["update_actor"]
    assert update["wall_s"] > 0 and any(op["name"].startswith("aten::") for op in update["top_host_ops"])
    assert (prof / "step_2" / "trace.json.gz").stat().st_size > 0


@pytest.mark.gpu
def test_torch_memory_writes_a_snapshot_of_the_listed_step(tmp_path):
    """verl's torch_memory profiler on a GPU: the listed steps' allocator history as pickles that load, with each
    step's allocation events (the policy's update allocates) and its segments; step 1 records through the engine's
    start (its graph capture) too, and step 2, unlisted, writes nothing."""
    import pickle
    prof = tmp_path / "mem"
    run(tmp_path, "trainer.device=cuda", "trainer.total_training_steps=3", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "global_profiler.tool=torch_memory", "global_profiler.steps=[1,3]",
        f"global_profiler.save_path={prof}", "+global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=20000")
    assert sorted(p.name for p in prof.iterdir()) == ["step_1", "step_3"]
    for step in (1, 3):
        assert [p.name for p in (prof / f"step_{step}").iterdir()] == ["torch_memory_rank0.pickle"]
        snapshot = pickle.loads((prof / f"step_{step}" / "torch_memory_rank0.pickle").read_bytes())
        trace = [e for device in snapshot["device_traces"] for e in device]
        assert snapshot["segments"] and any(e["action"] == "alloc" for e in trace) and len(trace) <= 20000
