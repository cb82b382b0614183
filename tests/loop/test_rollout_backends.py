"""End-to-end GRPO runs with each rollout backend, chosen explicitly: lathe's engine and transformers generate.

Kept short: no warm start, so a reward that needs no trained model (a hash of the response's characters, which
differs between random responses of equal length) gives the update a signal. The engine run also crashes
before step 3, resumes from step 2 and must equal the
uninterrupted run (test_ppo checks resume with the default backend, `auto`, which is the engine too).
"""

from __future__ import annotations

import logging

import torch

from lathe.engine import fp8
from lathe.engine.llm_engine import LatheEngine
from lathe.rollout.hf import HFRollout

from .test_ppo import deterministic, read_metrics, run, run_crash_and_resume

VAL = "val-core/lathe/arithmetic/reward/mean@1"


def _overrides(tmp_path, backend: str, steps: int) -> list[str]:
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return (sum(map(ord, solution_str)) % 3) / 2\n")
    return [f"actor_rollout_ref.rollout.name={backend}", "actor_rollout_ref.model.warm_start.steps=0",
            f"reward.custom_reward_function.path={reward_file}", "reward.timeout_s=0",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=2", f"trainer.test_freq={steps}",
            "trainer.val_before_train=false", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.actor.use_kl_loss=true"]


def test_transformers_rollout_run_trains_and_validates(tmp_path):
    trainer = run(tmp_path, *_overrides(tmp_path, "hf", steps=2))
    metrics = read_metrics(tmp_path / "run")
    assert isinstance(trainer.worker.rollout.backend, HFRollout) and trainer.global_step == 2
    assert metrics[2]["actor/grad_norm"] > 0 and VAL in metrics[2]


def test_engine_run_validates_and_resumes_exactly(tmp_path, monkeypatch):
    common = _overrides(tmp_path, "lathe", steps=3)
    whole, resumed = run_crash_and_resume(tmp_path, monkeypatch, common)
    assert isinstance(whole.worker.rollout.backend, LatheEngine)
    a, b = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[3]["actor/grad_norm"] > 0 and a[3]["critic/score/max"] > a[3]["critic/score/min"], \
        "no reward signal: the update would not move"
    assert VAL in a[3]
    for step in (1, 2, 3):
        assert deterministic(a[step]) == deterministic(b[step]), f"step {step} differs after resume"
    for (name, p), q in zip(whole.worker.model.named_parameters(), resumed.worker.model.parameters()):
        assert torch.equal(p, q), name


def test_verl_backend_name_runs_lathes_engine_with_one_notice(tmp_path, caplog):
    """rollout.name=vllm (every verl launch script sets it): lathe's engine runs, and says so once in the run. Its
    `engine_kwargs.vllm.quantization=fp8` acts: the engine's projections run in FP8 (`lathe.engine.fp8`), token-level
    TIS turns on, and the old-log-prob pass reports the gap between the FP8 rollout and the trainer."""
    with caplog.at_level(logging.INFO, logger="lathe"):
        trainer = run(tmp_path, *_overrides(tmp_path, "vllm", steps=1), "trainer.test_freq=-1", "trainer.save_freq=-1",
                      "+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=fp8")
    engine = trainer.worker.rollout.backend
    assert isinstance(engine, LatheEngine) and trainer.global_step == 1
    notices = [r.getMessage() for r in caplog.records if "lathe runs its own engine, not vLLM" in r.getMessage()]
    assert len(notices) == 1 and notices[0].startswith("rollout: lathe engine")
    assert engine.quantization == "fp8" and fp8.is_quantized(engine.model)
    metrics = read_metrics(tmp_path / "run")[1]
    assert 0 < metrics["training/rollout_probs_diff_mean"] < 0.1, metrics["training/rollout_probs_diff_mean"]
    assert any(k.startswith("rollout_corr/") for k in metrics), sorted(metrics)
