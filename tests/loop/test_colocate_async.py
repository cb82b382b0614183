"""verl V1's colocated asynchronous trainer (`trainer.v1.trainer_mode=colocate_async`, lathe.loop.colocate_async)
under `lathe train` on the built-in task, one CPU process: without warm-up batches it is the synchronous loop; with
them unfinished samples continue across steps under the new weights; stale groups are dropped or waited for; a
resumed run goes on; validation runs beside the streamed requests."""

from __future__ import annotations

import json

import pytest

from loop.test_async_agent import forced_calls  # noqa: F401
from loop.test_async_inprocess import COMPARED, train

COLOCATE = ["trainer.v1.trainer_mode=colocate_async"]
# responses long enough to outlast a slice of 2 engine steps, ended by eos at lengths of their own
LONG = ["data.max_response_length=12", "trainer.total_training_steps=4"]
SPANS = "training/off_policy/trajectory_spans/max"
WORST = "training/off_policy/trajectory_staleness_worst/max"


@pytest.fixture
def short_slices(monkeypatch):
    """Two engine steps between the driver's looks: responses finish across slices, and across steps."""
    import lathe.loop.colocate_async
    monkeypatch.setattr(lathe.loop.colocate_async, "SLICE_STEPS", 2)


def test_without_warmup_batches_it_is_the_synchronous_loop(tmp_path):
    sync = train(tmp_path / "sync")
    colocated = train(tmp_path / "colocated", *COLOCATE, "trainer.v1.colocate_async.num_warmup_batches=0")
    assert len(sync) == len(colocated) == 2
    for a, b in zip(sync, colocated):
        for key in COMPARED:
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
        assert b["colocate_async/interrupted"] == 0 and b[SPANS] == 1 and b[WORST] == 0
        assert b["training/off_policy/trajectory_staleness/mean"] == 0 and "timing_s/gen" in b


@pytest.mark.parametrize("extra", [
    pytest.param(["algorithm.adv_estimator=remax", "actor_rollout_ref.actor.use_kl_loss=true"], id="lora_remax_kl"),
    pytest.param(["reward_model.enable=true"], id="lora_reward_model")])
def test_lora_remax_a_reward_model_and_the_kl_loss_stream_as_the_synchronous_loop(tmp_path, extra):
    """Without warm-up batches: ReMax's greedy twins are requests of their own, a learned reward model scores the
    step's groups, LoRA's merged weights reach the engine as each version, the reference's KL loss reads the same
    batch; all as the synchronous loop (ReMax with a reward model is refused: lathe.config.rules_v1)."""
    from helpers import RM_TEMPLATE, tiny_reward_model
    from loop.test_async_lora import LORA
    if "reward_model.enable=true" in extra:
        extra = [*extra, f"reward_model.model.path={tiny_reward_model(tmp_path / 'rm', chat_template=RM_TEMPLATE)}",
                 "reward_model.max_length=256"]
    sync = train(tmp_path / "sync", *LORA, *extra)
    colocated = train(tmp_path / "colocated", *COLOCATE, "trainer.v1.colocate_async.num_warmup_batches=0", *LORA,
                      *extra)
    for a, b in zip(sync, colocated):
        for key in (*COMPARED, *(["actor/kl_loss"] if "actor/kl_loss" in a else [])):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])


def trained_uids(dumps, steps) -> list[str]:
    """The prompt group (`p<issue index>`) of every trained sample, from the steps' `rollout_data_dir` dumps."""
    return [json.loads(line)["uid"] for step in steps for line in (dumps / f"{step}.jsonl").read_text().splitlines()]


def test_unfinished_samples_continue_across_steps_under_the_new_weights(tmp_path, short_slices):
    dumps = tmp_path / "dumps"
    rows = train(tmp_path / "run", *COLOCATE, *LONG, "trainer.v1.sampler.max_off_policy_threshold=8",
                 f"trainer.rollout_data_dir={dumps}")
    assert len(rows) == 4
    uids = trained_uids(dumps, range(1, 5))                     # each prompt trained once, all its samples
    assert len(uids) == 4 * 4 * 4 and all(uids.count(u) == 4 for u in uids)
    assert sum(r["colocate_async/interrupted"] for r in rows) > 0, "precondition: some samples were interrupted"
    assert max(r[SPANS] for r in rows) >= 2                     # a response sampled by two weight versions
    assert max(r[WORST] for r in rows) >= 1                     # trained a step (or more) after it began
    assert all(r["colocate_async/queue_size"] + r["colocate_async/in_flight_prompts"] <= 4 for r in rows)
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in rows)       # (finite: the updates ran)


def test_stale_groups_are_dropped_or_waited_for(tmp_path, short_slices):
    dropped = train(tmp_path / "drop", *COLOCATE, *LONG, "trainer.v1.sampler.max_off_policy_threshold=1")
    assert sum(r.get("training/off_policy/evicted_samples", 0) for r in dropped) > 0
    assert all(r[WORST] == 0 and r[SPANS] == 1 for r in dropped)    # only groups begun in their own step train
    waited = train(tmp_path / "wait", *COLOCATE, *LONG, "trainer.v1.sampler.max_off_policy_threshold=1",
                   "trainer.v1.sampler.max_off_policy_strategy=wait")
    assert all(r["colocate_async/interrupted"] == 0 for r in waited)   # every group in flight is waited for
    assert not any("training/off_policy/evicted_samples" in r for r in waited)
    assert max(r[WORST] for r in waited) == 1                         # the warm-up batch trains a step later


def test_a_resumed_run_trains_each_prompt_once_and_validation_runs_beside_the_streamed_requests(tmp_path,
                                                                                             short_slices):
    run, dumps = tmp_path / "run", tmp_path / "dumps"
    args = [*COLOCATE, *LONG, "trainer.save_freq=2", "trainer.test_freq=1", f"trainer.rollout_data_dir={dumps}"]
    rows = train(run, *args)
    assert all(any(k.startswith("val-core/") for k in r) for r in rows)
    (run / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = train(run, *args)                                   # from step 2's checkpoint: steps 3 and 4 again
    assert len(resumed) == 4 and [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(any(k.startswith("val-core/") for k in r) for r in resumed[2:])
    # over steps 1-4 no prompt's group is trained twice or in part: those issued and not trained by step 2 (in
    # flight, interrupted or finished) are issued again
    uids = trained_uids(dumps, range(1, 5))
    assert len(uids) == 4 * 4 * 4 and all(uids.count(u) == 4 for u in uids), uids


def test_rows_drawn_from_the_loader_and_not_yet_issued_resume_from_their_batch():
    """One prompt per request, the loader's batches of 4: prompts 0-5 issued and trained, 6 and 7 drawn with 4-5 and
    not yet issued. The checkpoint resumes at the batch of 4 (its loader state) skipping 4 and 5, so 6 and 7 are
    issued after the resume instead of lost."""
    from types import SimpleNamespace
    from lathe.loop.fully_async import AsyncDriver, Ledger
    ledger = Ledger(issued=6, chunk_states={0: {"at": 0}, 4: {"at": 4}}, trained=set(range(6)))
    loader = SimpleNamespace(state_dict=lambda: {"at": 8})
    d = SimpleNamespace(ledger=ledger, rows=[{"row": 6}, {"row": 7}], version=3, syncs=3, updates_since_sync=0,
                        counters={}, pending=set, t=SimpleNamespace(loader=loader))
    state = AsyncDriver.state_dict(d)
    assert (state["issued"], state["loader"], state["trained"]) == (4, {"at": 4}, [4, 5])


DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]


def test_dynamic_sampling_evicts_groups_without_signal_and_trains_whole_steps_of_the_others(tmp_path):
    """verl V1's DAPO in its asynchronous modes: a group whose `acc` is the same for every sample is evicted as it
    finishes and a fresh prompt issued in its place, so every step trains train_batch_size groups, each with reward
    variance, each once; the evictions are counted (training/filter_groups/evicted_samples)."""
    dumps = tmp_path / "dumps"
    rows = train(tmp_path / "run", *COLOCATE, *DAPO, "trainer.total_training_steps=3",
                 f"trainer.rollout_data_dir={dumps}")
    assert len(rows) == 3
    assert sum(r["training/filter_groups/evicted_samples"] for r in rows) > 0, "precondition: groups without signal"
    samples = [json.loads(line) for step in range(1, 4) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    groups: dict[str, list[float]] = {}
    for s in samples:
        groups.setdefault(s["uid"], []).append(s["score"])
    assert len(samples) == 3 * 4 * 4 and len(groups) == 3 * 4 and all(len(g) == 4 for g in groups.values())
    assert all(len(set(g)) > 1 for g in groups.values())          # every trained group has signal


def test_dynamic_sampling_that_finds_no_signal_stops_and_says_so(tmp_path, capsys):
    from lathe.cli import main
    from loop.test_async_inprocess import FAST
    # no warm start: every sample scores 0, so no group ever has variance
    rc = main(["train", *FAST, f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.warm_start.steps=0",
               *COLOCATE, *DAPO, "algorithm.filter_groups.max_num_gen_batches=2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "9 prompt groups had no reward variance (by acc) while step 1 gathered 0 of its 4" in err, err
    assert "max_num_gen_batches x data.gen_batch_size = 8" in err


def test_multi_turn_trajectories_stream_as_the_synchronous_loop_without_warm_up(tmp_path, forced_calls):
    """The tool loop's trajectories through colocate_async's stream (tool calls in its threads, turns in the slices'
    engine steps): without warm-up batches the synchronous loop's losses, scores, tool calls and turns, and its
    validation (run through the stream too)."""
    from loop.test_async_agent import COMPARED as AGENT_COMPARED, train as agent_train
    val = ["trainer.test_freq=2", "data.val_max_samples=4", "data.val_batch_size=4"]
    sync = agent_train(tmp_path / "sync", *val)
    colocated = agent_train(tmp_path / "colocated", *COLOCATE, "trainer.v1.colocate_async.num_warmup_batches=0", *val)
    assert len(sync) == len(colocated) == 2
    assert 0 < sync[0]["agent/tool_calls/mean"], "precondition: tools were called"
    assert "val-core/lathe/secret_lookup/reward/mean@1" in colocated[-1]
    for a, b in zip(sync, colocated):
        for key in (*AGENT_COMPARED, *(k for k in a if k.startswith("val-"))):
            assert abs(a[key] - b[key]) <= 1e-4 * max(abs(a[key]), 1e-3), (key, a[key], b[key])
        assert b["colocate_async/interrupted"] == 0 and b[SPANS] == 1


@pytest.fixture
def instant_tools(monkeypatch):
    """Tool calls answered as they are made (their futures done at once): which turns the engine holds at a step's
    end then depends on the engine steps alone, not on when a tool thread answers."""
    from concurrent.futures import Future
    import lathe.rollout.agent.stream

    class Instant:
        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, *args, **kwargs):
            future = Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:          # noqa: BLE001 - the tool's error, as a thread's future carries it
                future.set_exception(e)
            return future

        def shutdown(self, *args, **kwargs):
            pass
    monkeypatch.setattr(lathe.rollout.agent.stream, "ThreadPoolExecutor", Instant)


def test_multi_turn_trajectories_continue_across_steps(tmp_path, forced_calls, short_slices, instant_tools):
    """With two warm-up batches and slices of 2 engine steps, trajectories are interrupted mid-turn and continue
    under the next weights (their tokens spanning versions), each prompt trained once. One sample a prompt
    (REINFORCE++), so that groups finish at their own engine steps (the agent load's groups of 4 end together)."""
    from loop.test_async_agent import train as agent_train
    dumps = tmp_path / "dumps"
    rows = agent_train(tmp_path / "run", *COLOCATE, "trainer.total_training_steps=4", "actor_rollout_ref.rollout.n=1",
                       "algorithm.adv_estimator=reinforce_plus_plus", "trainer.v1.colocate_async.num_warmup_batches=2",
                       f"trainer.rollout_data_dir={dumps}")
    assert len(rows) == 4 and sum(r["agent/tool_calls/mean"] for r in rows) > 0
    assert sum(r["colocate_async/interrupted"] for r in rows) > 0 and max(r[SPANS] for r in rows) >= 2
    uids = trained_uids(dumps, range(1, 5))
    assert len(uids) == 4 * 2 and len(set(uids)) == len(uids)
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in rows)
