"""Fully asynchronous training on CPU workers (1 trainer rank + 1 rollout replica over Ray/gloo): on-policy it is
the synchronous loop, with text and with image prompts (a vision-language model); off-policy it streams, stays within
its staleness bound, interrupts and continues responses at weight syncs, and resumes where its checkpoint left off."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'lathe[ray]')")

from helpers import kill_after_checkpoint, warm_started  # noqa: E402
from lathe.cli import main  # noqa: E402
from lathe.config import ConfigError, load_config  # noqa: E402
from lathe.loop.fully_async import AsyncDriver, Ledger  # noqa: E402

pytestmark = pytest.mark.slow


BASE = ["trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[console]"]
POOLS = ["rollout.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false"]
COMPARED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")
# fully async on-policy: no staleness, a weight sync after every update, steps of 2 mini-batches (the synchronous
# loop's 32 prompts), no partial rollouts, the trainer's own log-probs (tests/cluster/test_mesh_gpu.py: on GPUs)
ON_POLICY = ("async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
             "async_training.require_batches=2", "async_training.partial_rollout=false",
             "async_training.use_rollout_log_probs=false", "data.gen_batch_size=32")


def train(run_dir, *overrides: str, warm: bool = True) -> list[dict]:
    """`lathe train [PRESET] overrides...` into run_dir (from the shared warm start: tests/helpers.py); its
    metrics rows."""
    preset = [o for o in overrides[:1] if "=" not in o]
    overrides = overrides[len(preset):]
    shared = list(warm_started()) if warm else []
    assert main(["train", *preset, f"trainer.default_local_dir={run_dir}", *BASE, *shared, *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_on_policy_async_is_the_synchronous_loop(tmp_path):
    """staleness_threshold=0, one update per sync, one request per step: the same samples and the same updates; the
    trainer's recomputed log-probs are the engine's (it holds the rollout's weights at every update)."""
    steps = ["trainer.total_training_steps=2"]
    sync = train(tmp_path / "sync", *steps)
    on_policy = train(tmp_path / "async", *steps, *POOLS, *ON_POLICY)
    assert len(sync) == len(on_policy) == 2
    for a, b in zip(sync, on_policy):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
        assert b["fully_async/staleness/max"] == 0 and b["fully_async/partial/total_partial_num"] == 0
        assert b["fully_async/rollout_probs_diff_current_max"] == b["training/rollout_probs_diff_max"] < 1e-4


def test_killed_ranks_restart_every_pool_from_the_last_checkpoint(tmp_path):
    """trainer.restart_on_worker_failure=2: the reward model's own pool's rank SIGKILLed right after the step-2
    checkpoint (the trainer thread's scoring call finds it), then the new rollout replica right after the step-4 one
    (the driver's next call finds it). Each time every pool starts afresh, the trainer loads the last checkpoint and the
    new replica takes its weights; steps 1-6 run once each, each prompt trained once
    (tests/loop/test_async_restart.py checks the metrics against an uninterrupted run)."""
    from helpers import tiny_reward_model
    from lathe.loop.run import fit
    from lathe.loop.setup import build_trainer
    from loop.test_reward_model import rm_overrides
    run_dir, dumps = tmp_path / "run", tmp_path / "dumps"
    rm = [*rm_overrides(tiny_reward_model(tmp_path / "rm")), "reward_model.enable_resource_pool=true",
          "reward_model.nnodes=1", "reward_model.n_gpus_per_node=1", "ray_kwargs.ray_init.num_cpus=4"]
    cfg = load_config(None, [f"trainer.default_local_dir={run_dir}", *BASE, *warm_started(), *POOLS, *rm,
                             "trainer.total_training_steps=6", "trainer.save_freq=2",
                             "trainer.restart_on_worker_failure=2", f"trainer.rollout_data_dir={dumps}",
                             "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                             "async_training.require_batches=1", "async_training.partial_rollout=false",
                             "data.train_batch_size=0", "data.gen_batch_size=16", "rollout.total_rollout_steps=96"])
    t = build_trainer(cfg)
    reward_pid, rollout_pid = (g.nodes[0]["pid"] for g in (t.cluster.reward_group, t.cluster.rollout_group))
    kill_after_checkpoint(run_dir, reward_pid, step=2)
    restarted = lambda: t.cluster.rollout_group.nodes[0]["pid"]      # noqa: E731 - the replica of the second start
    kill_after_checkpoint(run_dir, restarted, step=4)
    try:
        fit(t)
    finally:
        t.close()
    assert reward_pid not in (g.nodes[0]["pid"] for g in (t.cluster.reward_group, t.cluster.rollout_group))
    assert rollout_pid != t.cluster.rollout_group.nodes[0]["pid"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    trained = [json.loads(line)["uid"] for step in range(1, 7)
               for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    n = cfg.actor_rollout_ref.rollout.n
    assert len(trained) == len(set(trained)) * n                         # each prompt's n samples trained once


def test_a_reward_model_and_a_teacher_on_pools_of_their_own_train_as_on_the_trainer_pool(tmp_path, caplog):
    """On-policy, a learned reward model and a distillation teacher on the trainer pool's ranks (Ray workers): the
    driver leaves the requests unscored, the trainer thread scores each batch with the reward model and the teacher's
    log-probs join the loss (both checked against the synchronous loop in process: tests/loop/test_async_reward_model.py,
    test_async_distillation.py). The same run with each on a pool of its own (`reward_model.enable_resource_pool`,
    `distillation.nnodes` x `n_gpus_per_node`: four groups of one rank, started at once) scores and distils the same
    samples alike: the same scores, losses and updates (norm-relative 1e-5)."""
    from cluster.test_ray import DISTILLATION, DISTILLED, assert_same, distillation_teacher
    from helpers import RM_TEMPLATE, tiny_reward_model
    from loop.test_reward_model import rm_overrides
    rm = rm_overrides(tiny_reward_model(tmp_path / "rm", chat_template=RM_TEMPLATE))
    teacher = distillation_teacher(tmp_path / "teacher")
    run = [*rm, *POOLS, *DISTILLATION, f"distillation.teacher_models.teacher_model.model_path={teacher}",
           "trainer.total_training_steps=2", "async_training.staleness_threshold=0",
           "async_training.trigger_parameter_sync_step=1", "async_training.require_batches=1",
           "async_training.partial_rollout=false", "data.train_batch_size=0", "data.gen_batch_size=16",
           "ray_kwargs.ray_init.num_cpus=4"]      # (four one-slot workers: the shared cluster's logical CPUs)
    colocated = train(tmp_path / "colocated", *run)
    caplog.clear()
    with caplog.at_level("INFO", logger="lathe"):
        pooled = train(tmp_path / "pooled", *run, "reward_model.enable_resource_pool=true", "reward_model.nnodes=1",
                       "reward_model.n_gpus_per_node=1", "distillation.nnodes=1", "distillation.n_gpus_per_node=1")
    started = [r.getMessage().split(":")[0] for r in caplog.records if " workers over " in r.getMessage()]
    assert sorted(started) == ["reward_model", "rollout", "teacher", "trainer"], started
    assert [r["step"] for r in colocated] == [r["step"] for r in pooled] == [1, 2]
    for a, b in zip(colocated, pooled):
        assert a["timing_s/reward"] > 0 and "reward_extra/acc/mean" not in a          # the reward model scored
        assert a["critic/score/max"] > a["critic/score/min"] and a["distillation/loss"] > 0.01
        assert b["timing_s/teacher"] > 0 and b["fully_async/staleness/max"] == 0
        assert_same(a, b, (*DISTILLED, "critic/score/mean", "critic/score/max", "critic/score/min", "actor/pg_loss",
                           "actor/grad_norm", "response_length/mean"))


OFF_POLICY = ["trainer.total_training_steps=4", *POOLS, "actor_rollout_ref.model.warm_start.steps=0",
              "data.max_response_length=12", "actor_rollout_ref.rollout.max_num_seqs=1", "actor_rollout_ref.rollout.n=4",
              "actor_rollout_ref.actor.optim.lr=1e-3", "reward.timeout_s=0",
              "async_training.staleness_threshold=0.5", "async_training.trigger_parameter_sync_step=2",
              "async_training.require_batches=1", "async_training.partial_rollout=true",
              "async_training.compute_prox_log_prob=true", "rollout.total_rollout_steps=64"]
STEP, PER_SYNC = 16, 32                      # prompts per update (ppo_mini_batch_size), per sync interval


def test_off_policy_streams_within_its_staleness_bound_and_resumes_without_losing_a_prompt(tmp_path):
    """Two updates per sync, staleness 0.5, partial rollout, one prompt per request, exactly the 64 prompts four
    steps need. A random model answers at length (rewarded by a hash of its characters, so that it learns) and the
    engine runs one sequence at a time: the rollout is the slow side (seconds of work left at the sync), and at the
    sync a response is mid-way (its prefill sampled its first token) and gets interrupted. Unless the pause falls
    between two responses (the step that finished one and the step that admits the next: about one pause in 12, seen
    in CI): nothing is mid-way then, rightly, and the run is repeated (three tries: all three miss about once in 1,700 runs)."""
    reward = tmp_path / "hash_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return (sum(map(ord, solution_str)) % 3) / 2\n")
    for attempt in range(3):
        run, dumps = tmp_path / f"run{attempt}", tmp_path / f"dumps{attempt}"
        args = [*OFF_POLICY, "trainer.save_freq=2", f"trainer.rollout_data_dir={dumps}",
                f"reward.custom_reward_function.path={reward}"]
        rows = train(run, *args, warm=False)
        if rows[1]["fully_async/sync/interrupted"] > 0:
            break
    assert [r["fully_async/policy_version"] for r in rows] == [0, 0, 1, 1]
    # the bound: the prompts begun before a sync and trained after it are at most staleness x per-interval prompts
    stale = [r["fully_async/count/stale_samples_processed"] for r in rows]
    assert stale[1] == 0 and stale[3] - stale[1] <= math.floor(0.5 * PER_SYNC), stale
    for r in rows:
        assert r["fully_async/staleness/max"] <= 1 + r["fully_async/partial/max_partial_span"], r
        assert 0 <= r["trainer/idle_ratio"] <= 1 and 0 <= r["rollouter/idle_ratio"] <= 1
        assert 0 <= r["trainer/idle_staleness_ratio"] <= r["trainer/idle_ratio"]
    assert rows[1]["fully_async/sync/interrupted"] > 0, "no response was mid-way at the sync, in three runs"
    assert sum(r["fully_async/partial/total_partial_num"] for r in rows) > 0, "no interrupted response was trained"
    # tokens sampled with the weights the trainer holds (first update after a sync) have the log-probs it computes:
    # continued responses took the new weights for their new tokens, and kept each old token's own log-prob
    for r in (rows[0], rows[2]):
        assert r["fully_async/rollout_probs_diff_current_max"] < 1e-4, r
    # resume from step 2: steps 3 and 4 again; over steps 1-4 every prompt is trained once, none lost, none twice
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(run, *args, warm=False)
    assert len(resumed) == 4 and [r["fully_async/policy_version"] for r in resumed[2:]] == [1, 1]
    trained = [json.loads(line)["uid"] for step in range(1, 5)
               for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert sorted(set(trained), key=lambda u: int(u[1:])) == [f"p{i}" for i in range(4 * STEP)]
    assert all(trained.count(u) == 4 for u in set(trained)), "a prompt's group (n=4) trained twice or in part"


def test_on_policy_lora_with_dynamic_sampling_on_a_sharded_trainer_is_the_synchronous_loop(tmp_path):
    """LoRA and DAPO's dynamic sampling together over Ray (tests/loop/test_async_{lora,dapo}.py run each in process,
    on an unsharded trainer): 2 FSDP2 trainer ranks gather and merge the adapted layers and send only those over the
    weight sync to the replica's process, and the Rollouter issues dynamic sampling's extra rounds; on-policy the
    same updates, rounds and samples as the synchronous loop in one process."""
    from loop.test_async_dapo import DAPO
    from loop.test_async_inprocess import ON_POLICY as ONE_REQUEST, assert_same_steps
    from loop.test_async_inprocess import train as fast_train
    from loop.test_async_lora import LORA
    sync = fast_train(tmp_path / "sync", *LORA, *DAPO)
    on_policy = fast_train(tmp_path / "async", *LORA, *DAPO, *ONE_REQUEST, "trainer.n_gpus_per_node=2",
                           "ray_kwargs.ray_init.num_cpus=4")     # (three one-slot workers of the shared cluster)
    assert_same_steps(sync, on_policy, keys=(*COMPARED, "train/num_gen_batches"))
    assert max(row["train/num_gen_batches"] for row in on_policy) > 1, "no extra round: dynamic sampling not shown"
    for row in on_policy:
        assert row["fully_async/rollout_probs_diff_current_max"] < 1e-4, row      # the replica holds the update
        assert 0 < row["fully_async/sync/fraction_of_full"] < 0.5, row             # the adapted layers only


def test_on_policy_remax_over_ray_is_the_synchronous_loop(tmp_path):
    """ReMax over Ray (tests/loop/test_async_remax.py runs it in process): each request's greedy twin is generated on
    the replica in its own process beside the samples, and its reward is the baseline; on-policy the synchronous
    loop's advantages and updates."""
    from loop.test_async_inprocess import ON_POLICY as ONE_REQUEST, assert_same_steps
    from loop.test_async_inprocess import train as fast_train
    remax = ["algorithm.adv_estimator=remax"]
    sync = fast_train(tmp_path / "sync", *remax)
    on_policy = fast_train(tmp_path / "async", *remax, *ONE_REQUEST, "data.gen_batch_size=2")
    assert_same_steps(sync, on_policy, keys=(*COMPARED, "critic/advantages/mean", "critic/advantages/max"))
    assert any(abs(r["critic/advantages/mean"]) > 1e-3 for r in sync), "precondition: the baselines are not the mean"


def test_the_reward_rises_as_in_the_synchronous_loop(tmp_path, monkeypatch):
    """The fully_async preset (staleness 0.5, a sync every 2 updates, partial rollout) on the built-in task (within 30
    steps: the run stops once its last 10 steps show the rise, tests/helpers.py stop_once_risen)."""
    from helpers import stop_once_risen
    stop_once_risen(monkeypatch, 0.06)
    rows = train(tmp_path, "fully_async", "trainer.total_training_steps=30")      # 10-step means 0.41 -> 0.51
    scores = [r["critic/score/mean"] for r in rows]
    first, last = sum(scores[:10]) / 10, sum(scores[-10:]) / 10
    assert last >= first + 0.06, f"reward went from {first:.2f} to {last:.2f} in {len(scores)} steps"


def _vl_run(tmp_path) -> tuple[list[str], str, object]:
    """(the keys of a GRPO run of a tiny random Qwen2.5-VL on 16 image prompts, its data file, its tokenizer dir)."""
    from loop.test_vl_train import _checkpoint, _data

    model, tokenizer = _checkpoint(tmp_path)
    data = _data(tmp_path, n=16)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return (sum(map(ord, solution_str)) % 3) / 2\n")
    return [f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
            f"data.train_files={data}", "data.max_prompt_length=64", f"reward.custom_reward_function.path={reward}",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=3e-3",
            "actor_rollout_ref.model.warm_start.steps=0", "trainer.device=cpu"], data, tokenizer


def test_on_policy_async_with_image_prompts_is_the_synchronous_loop(tmp_path, monkeypatch):
    """A tiny random Qwen2.5-VL on image prompts: each request carries its prompts' images to the replica, the trained
    batches carry them to the trainer, row by row (the replica's prompt tokens, the driver's images and the data
    file's row agree), and on-policy the run equals the synchronous one (same samples, losses and updates, and the
    same validation, which runs on the replicas)."""
    from lathe.data.dataset import RLDataset
    from lathe.data.multimodal import load_processor
    from lathe.loop import fully_async
    from lathe.models.hf import load_tokenizer

    keys, data, tokenizer = _vl_run(tmp_path)
    common = [*keys, f"data.val_files={data}", "trainer.test_freq=2", "data.max_response_length=3",
              "trainer.total_training_steps=2"]
    sync = train(tmp_path / "sync", *common, "data.train_batch_size=4", warm=False)
    taken = []                                        # take: (the batch, how it was gathered)
    take = fully_async.AsyncDriver.take
    monkeypatch.setattr(fully_async.AsyncDriver, "take", lambda d: taken.append(take(d)) or taken[-1])
    on_policy = train(tmp_path / "async", *common, *POOLS, "data.train_batch_size=0",
                      "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=1",
                      "async_training.require_batches=1", "async_training.partial_rollout=false",
                      "data.gen_batch_size=4", warm=False)
    assert len(sync) == len(on_policy) == 2 and len(taken) == 2
    trained = [batch for batch, _ in taken]
    for a, b in zip(sync, on_policy):
        assert all(math.isfinite(b[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"))
        for key in (*COMPARED, "actor/entropy", *(k for k in a if k.startswith("val-core/"))):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
    assert any(k.startswith("val-core/colours/") for k in on_policy[1]), "validated on the replicas, with images"
    assert sync[1]["critic/score/max"] > sync[1]["critic/score/min"], "precondition: the rewards differ"
    rows = RLDataset(data, load_tokenizer(str(tokenizer)), processor=load_processor(str(tokenizer)),
                     max_prompt_length=64)
    rows = {rows[i]["index"]: rows[i] for i in range(len(rows))}
    for batch in trained:
        assert len(batch) == 8
        for r in range(len(batch)):
            row = rows[batch["index"][r]]
            prompt = batch["prompts"][r][batch["attention_mask"][r, :batch["prompts"].shape[1]].bool()]
            assert prompt.tolist() == row["prompt_ids"], f"trained row {r}: the replica's prompt is another row's"
            for key in ("pixel_values", "image_grid_thw"):
                assert torch.equal(batch["multi_modal_inputs"][r][key], row["multi_modal_inputs"][key]), (r, key)


def test_image_responses_interrupted_at_a_sync_continue_on_the_new_vision_tower(tmp_path):
    """Off-policy with partial rollout on image prompts (staleness 1, a sync after every update, long responses one at
    a time: the rollout is the slow side, and at a sync a response is mid-way). The update moves the vision tower, so
    an interrupted response's images must be encoded again by the replica for its new tokens: their log-probs are then
    the trainer's at the first update after the sync (1e-8 here; the old tower's embeddings give 1e-3). A pause that
    falls between two responses interrupts nothing; the run is then repeated (three tries)."""
    keys, _, _ = _vl_run(tmp_path)
    args = [*keys, *POOLS, "data.val_files=null", "data.max_response_length=64",
            "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.max_num_seqs=1",
            "trainer.total_training_steps=3", "data.train_batch_size=0", "data.gen_batch_size=1",
            "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1",
            "async_training.require_batches=1", "async_training.partial_rollout=true",
            "async_training.compute_prox_log_prob=true", "reward.timeout_s=0"]
    for attempt in range(3):
        rows = train(tmp_path / f"run{attempt}", *args, warm=False)
        continued = [r for r in rows if r["fully_async/partial/total_partial_num"] > 0
                     and "fully_async/rollout_probs_diff_current_max" in r]
        if continued:
            break
    assert continued, "no interrupted response was continued and trained after a sync, in three runs"
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("actor/pg_loss", "actor/grad_norm"))
        if "fully_async/rollout_probs_diff_current_max" in r:
            assert r["fully_async/rollout_probs_diff_current_max"] < 1e-4, r


def test_the_ledger_resumes_at_the_oldest_untrained_chunk_and_skips_what_was_trained():
    ledger = Ledger()
    for first in range(0, 8, 2):                  # four chunks of two prompts
        ledger.chunk_states[first] = {"pos": first}
    ledger.issued = 8
    ledger.trained = {0, 1, 4, 5}                 # chunks 0 and 4 trained; 2 and 6 in flight or queued
    state = ledger.state_dict(pending={2, 3, 6, 7}, loader_state={"pos": 8})
    assert state == {"issued": 2, "loader": {"pos": 2}, "trained": [4, 5]}
    assert ledger.state_dict(pending=set(), loader_state={"pos": 8}) == {"issued": 8, "loader": {"pos": 8},
                                                                         "trained": []}
    ledger.forget_before(6)
    assert set(ledger.chunk_states) == {6} and ledger.trained == set()


def test_a_resumed_driver_takes_the_checkpoints_version_counts_and_prompt_position():
    d = AsyncDriver.__new__(AsyncDriver)              # only the fields load_state_dict touches
    loaded = []
    d.t = SimpleNamespace(loader=SimpleNamespace(load_state_dict=loaded.append))
    d.ledger, d.counters = Ledger(), {"stale_samples": 0, "stale_trajectories": 0}
    state = {"issued": 32, "loader": {"pos": 32}, "trained": [40, 41], "version": 3, "syncs": 3,
             "updates_since_sync": 1, "counters": {"stale_samples": 5, "stale_trajectories": 37}}
    d.load_state_dict(state)
    assert (d.version, d.syncs) == (4, 3), "saved between syncs: the replicas take the checkpoint's weights as new"
    assert d.counters == {"stale_samples": 5, "stale_trajectories": 37}
    assert (d.ledger.issued, d.ledger.skip, loaded) == (32, {40, 41}, [{"pos": 32}])


def test_chunks_go_to_the_replica_with_the_fewest_tokens_in_flight():
    """Rollout work is balanced over the replicas by tokens in flight (n samples of each prompt, each with the
    whole response budget), not dealt round robin: a replica whose requests finished takes the next chunks."""
    d = AsyncDriver.__new__(AsyncDriver)              # only the fields least_loaded and tokens read
    d.n, d.remax, d.load = 4, False, [0, 0, 0]
    d.t = SimpleNamespace(sampling=SimpleNamespace(max_tokens=10))
    assert d.tokens([[1] * 6, [2] * 2]) == 4 * (6 + 10) + 4 * (2 + 10)
    sent = []
    for chunk in ([[1] * 6], [[1] * 2], [[1] * 4], [[1] * 3]):
        replica = d.least_loaded()
        d.load[replica] += d.tokens(chunk)
        sent.append(replica)
    assert sent == [0, 1, 2, 1] and d.load == [64, 48 + 52, 56]   # (the first among equals; then the lightest)
    d.load[0] -= 64                                   # replica 0's request finished: it takes the next chunk
    assert d.least_loaded() == 0
    d.remax = True                                    # ReMax's greedy twin is one sample more per prompt
    assert d.tokens([[1] * 6]) == 5 * 16


def test_the_rollouter_is_held_back_when_the_interval_budget_is_spent_with_prompts_left():
    """`held_back` (what `trainer/idle_staleness_ratio` times): the budget cannot send a request, prompts remain."""
    d = AsyncDriver.__new__(AsyncDriver)              # only the fields held_back reads
    d.ledger, d.total_prompts, d.chunk, d.dapo = Ledger(issued=32), 64, 4, None
    for budget, issued, held in ((8, 32, False), (3, 32, True), (0, 32, True), (0, 64, False)):
        d.budget, d.ledger.issued = budget, issued
        assert d.held_back() is held, (budget, issued)
    d.dapo, d.budget = object(), 1                    # dynamic sampling sends while any budget is left
    assert not d.held_back()
    from lathe.loop.fully_async import staleness_hint
    hint = staleness_hint(0.4, 5, 1.0)
    assert "40%" in hint and "async_training.staleness_threshold=1" in hint and "trainer/idle_staleness_ratio" in hint


def test_a_trainer_waiting_for_prompts_that_cannot_come_fails_saying_why():
    d = AsyncDriver.__new__(AsyncDriver)              # only the fields check_waiting reads
    d.t = SimpleNamespace(cfg=load_config("default", POOLS))
    d.in_flight, d.queue, d.n, d.step_prompts, d.total_prompts, d.dapo = {}, deque(), 8, 16, 64, None
    d.ledger = Ledger(issued=64)
    with pytest.raises(RuntimeError, match="issued all 64 .* nothing more can come"):
        d.check_waiting(since=time.monotonic())
    d.ledger.issued, d.in_flight = 60, {60: (1, ["prompt"] * 4)}
    d.check_waiting(since=time.monotonic())           # in flight, within the timeout: keep waiting
    with pytest.raises(TimeoutError, match=r"no rollout request finished in \d+ s .* by replica: \{1: 4\}"):
        d.check_waiting(since=time.monotonic() - 601)


@pytest.mark.parametrize("overrides,message", [
    (["async_training.staleness_threshold=0.5"], "acts only in fully-asynchronous training"),
    (["actor_rollout_ref.hybrid_engine=false"], "no rollout pool is set"),
    ([*POOLS, "data.gen_batch_size=3"], "must divide a training step"),
    ([*POOLS, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"], "backend=nccl or auto"),
    ([*POOLS, "algorithm.rollout_correction=decoupled_geo_rs_seq_tis"], "compute_prox_log_prob=true"),
    (["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"], "rollout.n_gpus_per_node"),
])
def test_async_keys_are_refused_where_they_cannot_act(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", overrides)


def test_a_step_is_require_batches_mini_batches_of_prompts():
    cfg = load_config("default", [*POOLS, "async_training.require_batches=3", "data.train_batch_size=0"])
    assert cfg.data.train_batch_size == 48 and cfg.data.gen_batch_size == 1
    with pytest.warns(UserWarning, match="data.train_batch_size=256 has no effect .* = 16 prompts"):
        assert load_config("default", [*POOLS, "data.train_batch_size=256"]).data.train_batch_size == 16


def test_close_shuts_both_ends_of_the_weight_sync_before_waiting_for_either():
    """Closing an NCCL communicator waits for its other ranks to close it too: the driver asks the replicas and the
    trainer at once, then waits (asking the replicas alone waited out nccl_timeout at every run's end on GPUs); then
    every group stops, the reward model's and the teachers' own pools included (`restart` starts them again)."""
    from lathe.cluster import AsyncCluster
    log = []

    class Group:
        def __init__(self, name):
            self.name, self.world_size = name, 1

        def submit_each(self, role, method, per_rank):
            log.append(("submit", self.name, method))
            return [f"{self.name}.{method}"]

        def gather(self, refs, what, watching=None):
            log.append(("gather", self.name))
            return [None]

        def shutdown(self):
            log.append(("shutdown", self.name))

    cluster = AsyncCluster(Group("trainer"), Group("rollout"), None, None, None, False, [], 0)
    cluster.close()
    assert log[:2] == [("submit", "rollout", "shutdown"), ("submit", "trainer", "close_sync")]
    assert {entry[1] for entry in log[2:4]} == {"rollout", "trainer"} and all(e[0] == "gather" for e in log[2:4])
    assert log[4:] == [("shutdown", "rollout"), ("shutdown", "trainer")]
    log.clear()                     # the reward model's and the teachers' own pools go too (first: started last)
    AsyncCluster(Group("trainer"), Group("rollout"), None, None, None, False, [], 0, reward_group=Group("rm"),
                 teacher_group=Group("teacher")).close()
    assert log[4:] == [("shutdown", n) for n in ("teacher", "rm", "rollout", "trainer")]


@pytest.mark.parametrize("held", [True, False])
def test_the_trainers_wait_while_held_back_is_timed_and_hinted_once_after_two_steps(monkeypatch, caplog, held):
    """`trainer/idle_staleness_ratio` times the trainer's waits for samples (the driver's polls) while `held_back`:
    here each step waits 10 polls of 0.05 s, then trains 1 s (a fake clock; the loop itself is `_fit_async`), so a
    held-back run reports 1/3 of each step, as `trainer/idle_ratio` does, and one hint from its third step; a run not
    held back reports none and gives no hint."""
    import logging
    from concurrent.futures import Future

    from lathe.loop import fully_async as fa
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(fa, "time", SimpleNamespace(perf_counter=lambda: clock.now, monotonic=lambda: clock.now))

    class Driver:
        def __init__(self, t):
            self.at = SimpleNamespace(staleness_threshold=1.0, trigger_parameter_sync_step=1)
            self.version, self.updates_since_sync, self.syncs, self.busy, self.polls = 0, 0, 0, [0.0], 0

        def poll(self, wait_s):
            clock.now += wait_s
            self.polls += 1
            return 0

        def ready(self):
            return self.polls >= 10

        def take(self):
            self.polls = 0
            return "batch", {}

        def held_back(self):
            return held
        fill = check_waiting = lambda self, *a, **k: None
        staleness_metrics = step_metrics = lambda self, batch: {}
        sync_weights = state_dict = lambda self: {}

    class Now:                                       # the update runs at once (1 s on the clock)
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, *args):
            future = Future()
            future.set_result(fn(*args))
            return future
        shutdown = lambda self, wait: None           # noqa: E731

    def learn_batch(t, batch, current):
        clock.now += 1.0
        return {"perf/total_num_tokens": 1}
    rows = []
    monkeypatch.setattr(fa, "AsyncDriver", Driver)
    monkeypatch.setattr(fa, "ThreadPoolExecutor", Now)
    monkeypatch.setattr(fa, "learn_batch", learn_batch)
    monkeypatch.setattr(fa, "Progress", lambda *a, **k: SimpleNamespace(update=lambda *a: None, close=lambda: None))
    t = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(val_before_train=False, val_only=False,
                                                                    save_freq=0, test_freq=0),
                                            actor_rollout_ref=SimpleNamespace(model=SimpleNamespace(
                                                lora_adapter_path=None)), rollout=SimpleNamespace(test_freq=0)),
                        resume_state=None, val_dataset=None, global_step=0, total_steps=4,
                        tracker=SimpleNamespace(log=lambda metrics, step: rows.append((step, dict(metrics)))))
    with caplog.at_level(logging.WARNING, logger="lathe"):
        fa._fit_async(t, True)
    assert [step for step, _ in rows] == [1, 2, 3, 4]
    for step, r in rows:
        assert math.isclose(r["trainer/idle_ratio"], 1 / 3, rel_tol=1e-6), (step, r["trainer/idle_ratio"])
        assert math.isclose(r["trainer/idle_staleness_ratio"], 1 / 3 if held else 0.0, abs_tol=1e-9), (
            step, r["trainer/idle_staleness_ratio"])
    hints = [rec.getMessage() for rec in caplog.records if "trainer/idle_staleness_ratio" in rec.getMessage()]
    assert len(hints) == held and all("at step 3 " in h for h in hints), hints
