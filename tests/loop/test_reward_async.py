"""`reward_model.launch_reward_fn_async` (lathe.loop.reward_async): the step scores in the background while the
log-prob passes run, trains exactly as the foreground path, and surfaces failures and hangs at the join."""

from __future__ import annotations

import json
import time
import warnings

import pytest

from lathe.config import load_config
from lathe.config.support import IgnoredKeysWarning
from lathe.loop.reward_async import BackgroundScoring, RewardScoringTimeout, overlaps_reward
from lathe.loop import ppo
from lathe.loop.setup import build_trainer, prompt_batch
from lathe.reward import RewardManager
from lathe.reward.manager import RewardFunctionFailing
from lathe.track import Timer

from helpers import assert_close_rel
from loop.test_ppo import read_metrics, run, tiny

ASYNC = "reward_model.launch_reward_fn_async=true"
STEPS = ["trainer.test_freq=-1", "trainer.val_before_train=false"]
# the old-policy pass runs (two mini-batches) and the reference pass too (a KL loss): both overlap the scoring
PASSES = ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=true"]


@pytest.mark.parametrize("estimator,steps", [("grpo", 2), ("remax", 2), ("gae", 2)])
def test_background_scoring_trains_as_the_foreground_path(tmp_path, estimator, steps):
    common = [f"trainer.total_training_steps={steps}", *STEPS, *PASSES, f"algorithm.adv_estimator={estimator}"]
    run(tmp_path, *common, name="sync")
    run(tmp_path, *common, ASYNC, name="async")
    a, b = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert "timing_s/reward_wait" in b[step] and "timing_s/reward_wait" not in a[step]
        assert b[step]["timing_s/reward"] > 0 and "timing_s/old_log_prob" in b[step] and "timing_s/ref" in b[step]
        assert ("timing_s/values" in b[step]) == (estimator == "gae")
        keys = ["actor/pg_loss", "actor/grad_norm", "critic/score/mean", "critic/advantages/mean", "reward/num_errors"]
        for k in keys:
            assert_close_rel(b[step][k], a[step][k], rel=1e-6, name=f"step {step} {k}")
    assert 0 < a[steps]["critic/score/mean"] < 1 and a[steps]["actor/grad_norm"] > 0, "no signal: nothing compared"


SLOW_REWARD = """
import json, time
from lathe.reward.builtin import compute_score as builtin

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    start = time.monotonic()
    time.sleep(0.05)
    with open({log!r}, "a") as f:
        f.write(json.dumps(["reward", start, time.monotonic()]) + "\\n")
    return builtin(solution_str, ground_truth)
"""


def test_the_scoring_overlaps_the_log_prob_passes(tmp_path, monkeypatch):
    log = tmp_path / "events.jsonl"
    reward_file = tmp_path / "slow_reward.py"
    reward_file.write_text(SLOW_REWARD.format(log=str(log)))
    cfg = load_config(None, [*tiny(), f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=1",
                             *STEPS, *PASSES, ASYNC, f"reward.custom_reward_function.path={reward_file}",
                             "reward.timeout_s=0"])                 # in-process: in the background thread
    trainer = build_trainer(cfg)

    def hooked(name, real):
        def call(batch):
            start = time.monotonic()
            out = real(batch)
            with open(log, "a") as f:
                f.write(json.dumps([name, start, time.monotonic()]) + "\n")
            return out
        return call

    for method in ("compute_log_prob", "compute_ref_log_prob"):
        monkeypatch.setattr(trainer.worker, method, hooked(method, getattr(trainer.worker, method)))
    try:
        metrics = ppo.fit(trainer)
    finally:
        trainer.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    rewards = [e for e in events if e[0] == "reward"]
    passes = {e[0]: e for e in events if e[0] != "reward"}
    assert len(rewards) == 16 and set(passes) == {"compute_log_prob", "compute_ref_log_prob"}
    # the old-policy pass starts while the samples are being scored (the foreground path scores them all first)
    assert passes["compute_log_prob"][1] < sorted(e[2] for e in rewards)[len(rewards) // 2]
    assert metrics["timing_s/reward"] >= 16 * 0.05 and "timing_s/reward_wait" in metrics


class _Manager:
    """What BackgroundScoring reads of a reward manager."""
    name, timeout_s, num_workers = "slow_fn", 0.05, 1


def test_a_hung_scorer_stops_the_step_at_the_join_naming_it(monkeypatch):
    monkeypatch.setattr("lathe.loop.reward_async.SLACK_S", 0.2)
    pending, timer = BackgroundScoring(), Timer()
    pending.submit("reward", lambda: time.sleep(30), lambda r: {}, manager=_Manager(), num_samples=4)
    start = time.monotonic()
    with pytest.raises(RewardScoringTimeout, match=r"4 responses by the reward function slow_fn did not finish "
                                                   r"within 0 s \(reward.timeout_s=0.05 per sample"):
        pending.join(timer)
    assert time.monotonic() - start < 5 and "reward_wait" in timer.seconds


def test_a_failure_in_the_background_is_the_foreground_path_s_error(tmp_path):
    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                           "    return extra_info['no_such_field']\n")
    cfg = load_config(None, [*tiny(), f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=1",
                             *STEPS, "reward.timeout_s=0", "reward.max_failing_calls=1",
                             f"reward.custom_reward_function.path={reward_file}"])
    trainer, errors = build_trainer(cfg), []
    try:
        for launch_async in (False, True):                 # the same step, scored in the foreground, then not
            trainer.cfg.reward_model.launch_reward_fn_async = launch_async
            trainer.reward._failing.clear()                # a new streak
            with pytest.raises(RewardFunctionFailing) as err:
                ppo.train_step(trainer, prompt_batch(trainer.next_rows(), 1))
            errors.append(str(err.value))
    finally:
        trainer.close()
    assert errors[0] == errors[1] and "KeyError: 'no_such_field'" in errors[0]


def test_jobs_run_in_order_and_apply_at_the_join():
    manager, order = RewardManager(lambda *a, **k: 1.0, timeout_s=0), []
    pending, timer = BackgroundScoring(), Timer()
    pending.submit("reward", lambda: time.sleep(0.2) or order.append("a") or 1, lambda r: {"x": r},
                   manager=manager, num_samples=1)
    pending.submit("gen_max", lambda: order.append("b") or 2, lambda r: order.append("applied") or {"y": r},
                   manager=manager, num_samples=1)
    assert order == []                                     # nothing applied before the join
    assert pending.join(timer) == {"x": 1, "y": 2} and order == ["a", "b", "applied"]
    assert timer.seconds["reward"] >= 0.2 and set(timer.seconds) == {"reward", "gen_max", "reward_wait"}


def test_dynamic_sampling_and_a_rollout_pool_score_in_the_foreground_with_a_note():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dapo = load_config(None, [*tiny(), ASYNC, "algorithm.filter_groups.enable=true"])
        plain = load_config(None, [*tiny(), ASYNC])
    notes = [str(w.message) for w in caught if issubclass(w.category, IgnoredKeysWarning)]
    assert len(notes) == 1 and "launch_reward_fn_async" in notes[0] and "dynamic sampling" in notes[0]
    assert not overlaps_reward(dapo) and overlaps_reward(plain)


def test_a_judge_scores_in_the_foreground_and_its_rule_part_in_the_background(tmp_path):
    """An LLM judge shares the device with the actor's passes: it runs before them, as in the foreground path; the
    rule scores joined with its scores (judge.combine=sum) come from the background, the same as the foreground's."""
    from loop.test_judge import RUN, judge_overrides, tiny_judge
    path, rows = tiny_judge(tmp_path / "judge"), {}
    for name, extra in (("sync", []), ("async", [ASYNC])):
        cfg = load_config(None, [*RUN, *judge_overrides(path, "reward_model.judge.combine=sum"),
                                 "trainer.total_training_steps=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                 f"trainer.default_local_dir={tmp_path / name}", *extra])
        trainer, order = build_trainer(cfg), []
        for part, method in ((trainer.reward_model, "compute_rm_score"), (trainer.worker, "compute_log_prob")):
            real = getattr(part, method)
            setattr(part, method, lambda batch, real=real, method=method: order.append(method) or real(batch))
        try:
            ppo.fit(trainer)
        finally:
            trainer.close()
        assert order == ["compute_rm_score", "compute_log_prob"]
        rows[name] = read_metrics(tmp_path / name)[1]
    keys = ["critic/score/mean", "critic/score/max", "reward_judge/score/mean", "actor/pg_loss", "actor/grad_norm"]
    for k in keys:
        assert_close_rel(rows["async"][k], rows["sync"][k], rel=1e-6, name=k)
    assert "timing_s/reward_wait" in rows["async"] and rows["async"]["timing_s/reward_judge"] > 0


def test_the_batch_manager_s_one_call_bounds_the_background_join():
    from lathe.loop.reward_async import SLACK_S, scoring_bound_s
    from lathe.reward import BatchRewardManager

    with BatchRewardManager(lambda **kw: [], timeout_s=2.0) as manager, \
            RewardManager(lambda *a: 0.0, timeout_s=2.0, num_workers=4) as per_row:
        bound, why = scoring_bound_s(manager, 8)
        assert bound == 16.0 + SLACK_S and "8 samples in one call of the batch reward manager" in why
        assert scoring_bound_s(per_row, 8)[0] == 4.0 + SLACK_S
