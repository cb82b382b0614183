"""Off-policy fully-async training with dynamic sampling, ReMax and LoRA at once (both pools in this process:
tests/loop/test_async_inprocess.py): two updates per sync, staleness 0.5, partial rollout, one prompt per request.
The prompts trained after a sync that were begun before it stay within the bound, as without them, and a run resumed
from a checkpoint trains no prompt twice."""

from __future__ import annotations

import json
import math

from loop.test_async_inprocess import in_process_pools, train  # noqa: F401
from loop.test_async_dapo import DAPO
from loop.test_async_lora import LORA

STEP, PER_SYNC = 4, 8                      # prompts per update (ppo_mini_batch_size), per sync interval


def test_off_policy_dapo_remax_lora_stays_within_the_staleness_bound(tmp_path, in_process_pools):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    args = [*DAPO, *LORA, "algorithm.adv_estimator=remax", "data.gen_batch_size=1", "rollout.n_gpus_per_node=1",
            "actor_rollout_ref.hybrid_engine=false", "data.train_batch_size=0", "trainer.total_training_steps=4",
            "async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=2",
            "async_training.require_batches=1", "async_training.partial_rollout=true",
            "async_training.compute_prox_log_prob=true", "trainer.save_freq=2", f"trainer.rollout_data_dir={dumps}"]
    rows = train(run, *args)
    assert [r["fully_async/policy_version"] for r in rows] == [0, 0, 1, 1]
    stale = [r["fully_async/count/stale_samples_processed"] for r in rows]
    assert stale[1] == 0 and stale[3] - stale[1] <= math.floor(0.5 * PER_SYNC), stale
    for r in rows:
        assert r["fully_async/staleness/max"] <= 1 + r["fully_async/partial/max_partial_span"], r
        assert r["train/num_gen_batches"] >= STEP and r["fully_async/dapo/dropped_groups"] >= 0
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean"))
    assert sum(r["fully_async/dapo/dropped_groups"] for r in rows) > 0, "precondition: some groups were dropped"
    # the first update after a sync: the tokens sampled with the weights the trainer holds have its log-probs (when
    # any of the batch's tokens were: the third step's may all have been sampled before the sync)
    assert "fully_async/rollout_probs_diff_current_max" in rows[0]
    for r in (rows[0], rows[2]):
        assert r.get("fully_async/rollout_probs_diff_current_max", 0) < 1e-4, r
    # resumed from step 2 (its checkpoint holds the adapters): steps 3 and 4 again, and over steps 1-4 no prompt's
    # group is trained twice or in part (dropped groups are done with; kept ones not yet trained are issued again)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(run, *args)
    assert len(resumed) == 4 and [r["fully_async/policy_version"] for r in resumed[2:]] == [1, 1]
    trained = [json.loads(line)["uid"] for step in range(1, 5)
               for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert len(trained) == 4 * STEP * 4 and all(trained.count(u) == 4 for u in set(trained)), trained
