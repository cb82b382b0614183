"""BatchRewardManager (verl's `batch` reward manager): one call per batch, results judged as the per-row manager
judges them, and a call that fails stops the run naming the function, the batch size and what came back."""

import logging
import os
import pickle
import textwrap
import time

import pytest

from lathe.reward.batch import BatchRewardError, BatchRewardManager
from lathe.reward.custom import load_reward_fn
from lathe.reward.manager import RewardFunctionFailing, RewardManager
from lathe.reward.scoring import coerce_result

from reward.test_manager import _gone

MODES = [0.0, 5.0]      # in this process; in a forked worker with a timeout


def _items(solutions, truths=None, sources=None):
    truths = truths or ["a"] * len(solutions)
    sources = sources or [f"src/{i % 3}" for i in range(len(solutions))]
    return [{"data_source": ds, "solution_str": s, "ground_truth": gt, "extra_info": {"index": i}}
            for i, (ds, s, gt) in enumerate(zip(sources, solutions, truths))]


def _row_float(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth) + 0.25 * extra_info["index"]


def _row_dict(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str == ground_truth
    return {"score": float(hit), "acc": hit, "length": len(solution_str), "source": data_source}


def _batched(row_fn):
    def fn(data_sources, solution_strs, ground_truths, extra_infos):
        return [row_fn(*args) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]
    return fn


def _reference(row_fn, items):
    """Each row scored directly, judged as the per-row manager judges a result: (score, extra)."""
    out = []
    for i, it in enumerate(items):
        score, extra, _, _ = coerce_result(row_fn(it["data_source"], it["solution_str"], it["ground_truth"],
                                                  it["extra_info"]), i, "ref")
        out.append((score, extra))
    return out


@pytest.fixture
def managers():
    made = []

    def make(fn, cls=BatchRewardManager, **kwargs):
        made.append(cls(fn, **kwargs))
        return made[-1]

    yield make
    for m in made:
        m.close()


def _write(tmp_path, body: str, name: str = "batch_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("timeout_s", MODES)
@pytest.mark.parametrize("row_fn", [_row_float, _row_dict])
def test_scores_and_extras_equal_the_per_row_reference(managers, timeout_s, row_fn):
    items = _items(["a", "b", "a", "ccc", "a", "b", "b"])
    results = managers(_batched(row_fn), timeout_s=timeout_s).score(items)
    assert [(r.score, r.extra) for r in results] == _reference(row_fn, items)
    assert all(r.error is None for r in results)
    # the per-row manager on the same rows gives the same results
    per_row = managers(row_fn, cls=RewardManager, timeout_s=timeout_s).score(items)
    assert [(r.score, r.extra) for r in results] == [(r.score, r.extra) for r in per_row]


@pytest.mark.parametrize("timeout_s", MODES)
def test_one_call_per_batch_with_the_rows_as_lists(managers, timeout_s, tmp_path):
    log = tmp_path / "calls.txt"

    def fn(data_sources, solution_strs, ground_truths, extra_infos):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {data_sources} {solution_strs} {ground_truths} {extra_infos}\n")
        return [1.0] * len(solution_strs)

    m = managers(fn, timeout_s=timeout_s)
    m.score(_items(["x", "y"], ["1", "2"], ["p", "q"]))
    m.score(_items(["z"], ["3"], ["r"]))
    calls = log.read_text().splitlines()
    assert [c.split(" ", 1)[1] for c in calls] == [
        "['p', 'q'] ['x', 'y'] ['1', '2'] [{'index': 0}, {'index': 1}]", "['r'] ['z'] ['3'] [{'index': 0}]"]
    assert {int(c.split()[0]) == os.getpid() for c in calls} == {timeout_s == 0}


@pytest.mark.parametrize("timeout_s", MODES)
@pytest.mark.parametrize("returned,what", [
    ("[1.0] * (len(solution_strs) - 1)", r"returned 3 results \(\[1.0, 1.0, 1.0\]\) for a batch of 4 responses"),
    ("[1.0] * (len(solution_strs) + 2)", r"returned 6 results .* for a batch of 4 responses"),
    ("0.5", r"returned a float \(0.5\) instead of a list of results for a batch of 4 responses"),
    ("{'score': [1.0] * 4}", r"returned a dict with keys \['score'\] instead of a list of results"),
    ("(x for x in solution_strs)", r"returned a generator without a length"),
])
def test_the_wrong_number_of_results_stops_the_run_naming_the_function(managers, tmp_path, timeout_s, returned,
                                                                        what):
    path = _write(tmp_path, f"""
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            return {returned}
    """)
    m = managers(load_reward_fn(str(path), batch=True), timeout_s=timeout_s)
    with pytest.raises(BatchRewardError, match=r"reward function compute_score from '.*batch_reward.py' "
                                                r"\(reward_model.reward_manager=batch\) " + what) as info:
        m.score(_items(["a", "b", "c", "d"]))
    assert "one float, or dict with a 'score' key, per response" in str(info.value)


@pytest.mark.parametrize("timeout_s", MODES)
def test_an_exception_stops_the_run_with_its_traceback(managers, tmp_path, timeout_s):
    path = _write(tmp_path, """
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            raise ValueError("the judge is down")
    """)
    m = managers(load_reward_fn(str(path), batch=True), timeout_s=timeout_s)
    with pytest.raises(BatchRewardError, match=r"(?s)compute_score from .* raised ValueError: the judge is down on a "
                                               r"batch of 3 responses\n.*Traceback.*batch_reward.py") as info:
        m.score(_items(["a", "b", "c"]))
    assert "Fix the function" in str(info.value)


def test_a_call_that_does_not_answer_times_out_and_its_worker_is_killed(managers):
    def slow(data_sources, solution_strs, ground_truths, extra_infos):
        if solution_strs[0] == "hang":
            time.sleep(60)
        return [1.0] * len(solution_strs)

    m = managers(slow, timeout_s=0.25)
    m.start()
    pid = m.worker_pids()[0]
    start = time.monotonic()
    with pytest.raises(BatchRewardError, match=r"slow .*did not answer within 1 s for a batch of 4 responses "
                                               r"\(reward.timeout_s=0.25 per response, one call for the batch\); its "
                                               r"worker process was killed"):
        m.score(_items(["hang", "b", "c", "d"]))
    assert time.monotonic() - start < 5
    assert m.worker_pids() == [] and _gone(pid)
    # a fresh worker scores the next call (40 rows: 10 s, room for the fork on a busy machine)
    assert [r.score for r in m.score(_items(["a"] * 40))] == [1.0] * 40


def test_a_worker_that_dies_names_its_exit_code(managers):
    def crash(data_sources, solution_strs, ground_truths, extra_infos):
        os._exit(3)

    with pytest.raises(BatchRewardError, match=r"worker process died \(exit code 3\) while scoring a batch of 2"):
        managers(crash, timeout_s=5.0).score(_items(["a", "b"]))


@pytest.mark.parametrize("timeout_s", MODES)
def test_a_bad_row_costs_that_row_only_and_is_counted(managers, caplog, timeout_s):
    def fn(data_sources, solution_strs, ground_truths, extra_infos):
        return [None if s == "bad" else {"score": 1.0, "note": "text"} for s in solution_strs]

    m = managers(fn, timeout_s=timeout_s)
    with caplog.at_level(logging.WARNING, logger="lathe.reward"):
        results = m.score(_items(["a", "bad", "c", "d"]))
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 1.0] and results[0].extra == {}
    assert "returned None for sample 1" in results[1].error
    assert m.metrics() == {"reward/num_errors": 1, "reward/num_timeouts": 0}
    assert "failed on sample 1 of 4" in caplog.text and "non-numeric extra values for keys ['note']" in caplog.text


def test_a_function_failing_most_rows_stops_after_max_failing_calls(managers):
    m = managers(lambda data_sources, solution_strs, ground_truths, extra_infos: [float("nan")] * len(solution_strs),
                 timeout_s=0, max_failing_calls=2)
    m.score(_items(["a", "b"]))
    with pytest.raises(RewardFunctionFailing, match=r"in 2 scoring calls in a row"):
        m.score(_items(["a", "b"]))


def test_an_unpicklable_row_is_named(managers):
    items = _items(["a", "b", "c"])
    items[2]["extra_info"] = {"handle": lambda: None}
    with pytest.raises(BatchRewardError, match=r"batch of 3 responses could not be sent to its worker process .*"
                                               r"rows \[2\] hold values that cannot be pickled"):
        managers(_batched(_row_dict), timeout_s=5.0).score(items)


def test_the_function_itself_is_never_pickled(managers):
    """A closure over an unpicklable object scores in a worker: the forked worker inherits it."""
    lock = __import__("threading").Lock()

    def fn(data_sources, solution_strs, ground_truths, extra_infos):
        with lock:
            return [2.0] * len(solution_strs)

    with pytest.raises(Exception):
        pickle.dumps(fn)
    assert [r.score for r in managers(fn, timeout_s=5.0).score(_items(["a"]))] == [2.0]


def test_reward_kwargs_reach_the_function_and_pickle_with_it(managers, tmp_path):
    path = _write(tmp_path, """
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0, scale=1.0):
            return [{"score": scale * (s == gt) + bonus, "bonus": bonus} for s, gt in zip(solution_strs, ground_truths)]
    """)
    fn = load_reward_fn(str(path), reward_kwargs={"bonus": 0.5, "scale": 2.0}, batch=True)
    again = pickle.loads(pickle.dumps(fn))
    assert again.batch and again.reward_kwargs == {"bonus": 0.5, "scale": 2.0}
    for f in (fn, again):
        results = managers(f, timeout_s=5.0).score(_items(["a", "b"]))
        assert [(r.score, r.extra) for r in results] == [(2.5, {"bonus": 0.5}), (0.5, {"bonus": 0.5})]


def test_empty_batch_calls_nothing(managers):
    m = managers(lambda **kw: pytest.fail("called"), timeout_s=0)
    assert m.score([]) == []

