"""A vision-language GRPO run on two Ray workers (FSDP2 ranks over gloo on CPU; the vision blocks and the language
model's layers sharded) equals the one-process run: the same samples from each rank's engine on its share of the
image prompts, the same losses and gradient norms up to summation order; its checkpoint loads as a VL model. With
LoRA too (adapters on the language model's layers, each rank's engine on the merged weights)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from loop.test_ppo import read_metrics, run  # noqa: E402
from loop.test_vl_train import vl_keys  # noqa: E402

pytestmark = pytest.mark.slow
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_workers_equal_one_process_on_image_prompts(tmp_path, lora):
    common = [*vl_keys(tmp_path, "(sum(map(ord, solution_str)) % 3) / 2", rows=16, response_length=3),
              "trainer.total_training_steps=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.actor.optim.lr=3e-3", "trainer.device=cpu",
              *(["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"] if lora else [])]
    run(tmp_path, *common, name="one")
    run(tmp_path, *common, "trainer.n_gpus_per_node=2", "trainer.save_freq=2", name="two")
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2]
    assert one[2]["actor/grad_norm"] > 0 and one[2]["critic/score/max"] > one[2]["critic/score/min"]
    for step in (1, 2):
        for key in COMPARED:
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), (step, key)
    from lathe.models.vl import load_lathe_vl_model          # the sharded run's checkpoint: a VL model again
    saved = load_lathe_vl_model(tmp_path / "two" / "global_step_2" / "actor" / "huggingface")
    assert set(saved.state_dict()) == set(load_lathe_vl_model(tmp_path / "model").state_dict())
