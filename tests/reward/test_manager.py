import logging
import os
import time

import pytest

from lathe.reward.custom import load_reward_fn
from lathe.reward.manager import RewardFunctionFailing, RewardManager, ScoreResult


def _items(solutions, truth="a", data_source="test/source"):
    return [
        {"data_source": data_source, "solution_str": s, "ground_truth": truth, "extra_info": {"index": i}}
        for i, s in enumerate(solutions)
    ]


def _exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)


def _gone(pid: int) -> bool:
    """True once the process no longer exists (reaped: no zombie left behind)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def managers():
    """Create managers through this and they are closed even when a test fails."""
    made = []

    def make(fn, **kwargs):
        made.append(RewardManager(fn, **kwargs))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_scores_in_input_order(managers, timeout_s):
    m = managers(_exact, timeout_s=timeout_s)
    solutions = ["a" if i % 4 == 0 else "b" for i in range(100)]
    results = m.score(_items(solutions))
    assert [r.score for r in results] == [float(s == "a") for s in solutions]
    assert all(isinstance(r, ScoreResult) and r.error is None and not r.timed_out for r in results)
    assert m.metrics() == {"reward/num_errors": 0, "reward/num_timeouts": 0}
    assert (m.worker_pids() == []) == (timeout_s == 0.0)


def test_in_process_mode_starts_no_process(managers):
    parent = os.getpid()
    m = managers(lambda ds, s, gt, extra_info=None: float(os.getpid() == parent), timeout_s=0)
    assert [r.score for r in m.score(_items(["x", "y"]))] == [1.0, 1.0]
    assert m.worker_pids() == []


def test_workers_run_in_another_process_and_need_no_pickling(managers):
    parent = os.getpid()
    local_state = {"offset": 0.25}  # a closure over a local: not picklable, inherited by fork
    m = managers(lambda ds, s, gt, extra_info=None: float(os.getpid() != parent) + local_state["offset"])
    assert [r.score for r in m.score(_items(["x", "y"]))] == [1.25, 1.25]


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_raising_on_every_third_sample(managers, caplog, timeout_s):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["index"] % 3 == 0:
            raise ValueError(f"bad sample {extra_info['index']}")
        return float(solution_str == ground_truth)

    m = managers(flaky, timeout_s=timeout_s)
    solutions = ["a", "a", "b", "a", "b", "a", "a"]
    with caplog.at_level(logging.WARNING, logger="lathe.reward"):
        results = m.score(_items(solutions, truth="a", data_source="my/src"))
    expected = [0.0 if i % 3 == 0 else float(s == "a") for i, s in enumerate(solutions)]
    assert [r.score for r in results] == expected
    assert [r.error for r in results if r.error] == ["ValueError: bad sample 0", "ValueError: bad sample 3", "ValueError: bad sample 6"]
    assert m.metrics() == {"reward/num_errors": 3, "reward/num_timeouts": 0}
    assert m.metrics() == {"reward/num_errors": 0, "reward/num_timeouts": 0}  # counts reset
    records = [r for r in caplog.records if r.name == "lathe.reward"]
    assert len(records) == 1  # the first error of the call only
    message = records[0].getMessage()
    assert "ValueError: bad sample 0" in message and "'my/src'" in message and "3 failed" in message
    assert "ground_truth='a'" in message


@pytest.mark.parametrize("hang", ["sleep", "busy"])
def test_a_hanging_sample_times_out_and_its_worker_is_killed(managers, caplog, hang):
    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            while True:
                if hang == "sleep":
                    time.sleep(100)
        return float(solution_str == ground_truth)

    m = managers(stuck, timeout_s=0.5)
    m.score(_items(["a"]))  # start the worker
    (old_pid,) = m.worker_pids()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lathe.reward"):
        results = m.score(_items(["a", "b", "hang", "a", "a"]))
    elapsed = time.monotonic() - start
    assert elapsed < 3.0
    assert [r.score for r in results] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert [r.timed_out for r in results] == [False, False, True, False, False]
    assert results[2].error == "timed out after 0.5 s"
    assert m.metrics() == {"reward/num_errors": 0, "reward/num_timeouts": 1}
    assert _gone(old_pid)
    (new_pid,) = m.worker_pids()
    assert new_pid != old_pid and not _gone(new_pid)
    assert any("took longer than 0.5 s on sample 2" in r.getMessage() for r in caplog.records)
    m.close()
    assert _gone(new_pid) and m.worker_pids() == []


def test_timeouts_with_two_workers_keep_order(managers):
    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(100)
        return float(solution_str == ground_truth)

    m = managers(stuck, timeout_s=0.5, num_workers=2)
    solutions = ["a", "b"] * 20
    solutions[7] = solutions[30] = "hang"
    results = m.score(_items(solutions))
    assert [r.score for r in results] == [float(s == "a") for s in solutions]
    assert [i for i, r in enumerate(results) if r.timed_out] == [7, 30]
    assert len(m.worker_pids()) == 2


def test_a_worker_that_dies_costs_one_sample(managers):
    def crash(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "die":
            os._exit(7)
        return float(solution_str == ground_truth)

    m = managers(crash)
    results = m.score(_items(["a", "die", "a", "b"]))
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert "exit code 7" in results[1].error and not results[1].timed_out
    assert m.metrics()["reward/num_errors"] == 1


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_invalid_return_values_are_errors(managers, timeout_s):
    values = {"ok": 0.5, "str": "abc", "nan": float("nan"), "bool": True}
    m = managers(lambda ds, s, gt, extra_info=None: values[s], timeout_s=timeout_s)
    results = m.score(_items(list(values)))
    assert [r.score for r in results] == [0.5, 0.0, 0.0, 1.0]
    assert "returned 'abc' for sample 1" in results[1].error
    assert "nan" in results[2].error
    assert m.metrics()["reward/num_errors"] == 2


def test_dict_results_from_a_file_and_one_warning_for_dropped_extras(managers, caplog, tmp_path):
    path = tmp_path / "r.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth), 'acc': solution_str == ground_truth, 'pred': solution_str}\n"
    )
    m = managers(load_reward_fn(str(path)), timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="lathe.reward"):
        first = m.score(_items(["a", "b"]))
        m.score(_items(["a", "b"]))
    assert [(r.score, r.extra) for r in first] == [(1.0, {"acc": 1.0}), (0.0, {"acc": 0.0})]
    warnings = [r.getMessage() for r in caplog.records if "non-numeric" in r.getMessage()]
    assert len(warnings) == 1 and "pred" in warnings[0]


def test_bad_items_fail_fast_naming_the_item(managers):
    m = managers(_exact, timeout_s=0)
    with pytest.raises(KeyError, match=r"item 1 lacks \['ground_truth'\]"):
        m.score([{"data_source": "d", "solution_str": "a", "ground_truth": "a"}, {"data_source": "d", "solution_str": "a"}])


def test_close_is_idempotent_and_scoring_restarts(managers):
    m = managers(_exact)
    m.score(_items(["a"]))
    pids = m.worker_pids()
    m.close()
    m.close()
    assert all(_gone(p) for p in pids)
    assert [r.score for r in m.score(_items(["a"]))] == [1.0]
    with RewardManager(_exact) as scoped:
        scoped.score(_items(["a"]))
        scoped_pids = scoped.worker_pids()
    assert scoped_pids and all(_gone(p) for p in scoped_pids)


def test_bad_arguments():
    with pytest.raises(TypeError, match="not callable"):
        RewardManager("compute_score")
    with pytest.raises(ValueError, match="num_workers=0"):
        RewardManager(_exact, num_workers=0)


def test_an_unpicklable_item_fails_alone(managers):
    m = managers(_exact)
    items = _items(["a", "a", "b"])
    items[1]["extra_info"] = {"callback": lambda: None}
    results = m.score(items)
    assert [r.score for r in results] == [1.0, 0.0, 0.0]
    assert "sample 1 could not be sent" in results[1].error
    assert results[0].error is None and results[2].error is None
    assert m.score([]) == []


@pytest.mark.parametrize("timeout_s", [0.0, 5.0])
def test_a_function_failing_wholesale_stops_after_three_calls_with_its_first_error(managers, timeout_s):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        if extra_info["index"] == 0 or solution_str != "ok":
            raise KeyError(f"no field for {solution_str}")
        return 1.0

    m = managers(broken, timeout_s=timeout_s)
    m.score(_items(["x", "y", "z"]))
    m.score(_items(["x", "y", "z"]))
    m.score(_items(["x", "ok", "ok"]))          # 1 of 3 fails: not a failing call, the streak restarts
    m.score(_items(["a", "b"]))
    m.score(_items(["a", "b"]))
    with pytest.raises(RewardFunctionFailing, match=r"3 scoring calls in a row") as err:
        m.score(_items(["a", "b"]))
    text = str(err.value)
    assert "2 of 2 samples failed" in text and "KeyError: 'no field for a'" in text and "max_failing_calls" in text


def test_wholesale_failure_stop_can_be_turned_off(managers):
    m = managers(lambda *a, **k: 1 / 0, timeout_s=0.0, max_failing_calls=0)
    for _ in range(5):
        assert [r.score for r in m.score(_items(["a"]))] == [0.0]
