import pickle
import textwrap

import pytest

from lathe.reward.custom import RewardFn, load_reward_fn
from lathe.reward.registry import default_compute_score


def _write(tmp_path, body: str, name: str = "my_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


FLOAT_FN = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)
"""

DICT_FN = """
    def my_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        hit = solution_str == ground_truth
        return {"score": float(hit) + bonus, "acc": hit, "length": len(solution_str)}
"""


def test_float_function_from_file(tmp_path):
    fn = load_reward_fn(str(_write(tmp_path, FLOAT_FN)))
    assert fn("src", " 4 ", "4") == 1.0
    assert fn("src", "5", "4", {"index": 1}) == 0.0


def test_dict_function_with_name_and_reward_kwargs(tmp_path):
    fn = load_reward_fn(str(_write(tmp_path, DICT_FN)), name="my_score", reward_kwargs={"bonus": 0.5})
    assert fn("src", "ab", "ab") == {"score": 1.5, "acc": True, "length": 2}
    assert fn("src", "a", "ab")["score"] == 0.5


def test_positional_only_names_still_work(tmp_path):
    body = """
        def compute_score(ds, sol, gt, extra):
            return float(sol == gt)
    """
    fn = load_reward_fn(str(_write(tmp_path, body)))
    assert fn("src", "x", "x") == 1.0


def test_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path, FLOAT_FN)
    assert load_reward_fn("~/my_reward.py")("s", "1", "1") == 1.0


def test_none_path_gives_the_default_dispatcher():
    assert load_reward_fn(None) is default_compute_score
    with pytest.raises(ValueError, match="reward_kwargs"):
        load_reward_fn(None, reward_kwargs={"bonus": 1})


def test_loaded_function_pickles_by_path(tmp_path):
    fn = load_reward_fn(str(_write(tmp_path, DICT_FN)), name="my_score", reward_kwargs={"bonus": 2.0})
    clone = pickle.loads(pickle.dumps(fn))
    assert isinstance(clone, RewardFn) and clone is not fn
    assert clone("s", "a", "a")["score"] == 3.0


def test_two_files_with_the_same_name_do_not_clash(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fa = load_reward_fn(str(_write(tmp_path / "a", "def compute_score(*a, **k):\n    return 1.0\n", "r.py")))
    fb = load_reward_fn(str(_write(tmp_path / "b", "def compute_score(*a, **k):\n    return 2.0\n", "r.py")))
    assert (fa("s", "x", "y"), fb("s", "x", "y")) == (1.0, 2.0)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_fn(str(missing))


def test_missing_function_lists_what_the_file_defines(tmp_path):
    path = _write(tmp_path, textwrap.dedent(DICT_FN) + "\nimport os\nhelper = lambda: 1\n")
    with pytest.raises(AttributeError) as info:
        load_reward_fn(str(path), name="my_scor")
    message = str(info.value)
    assert "'my_scor'" in message and "my_score" in message and "helper" in message
    assert "Did you mean 'my_score'" in message
    assert "'os'" not in message  # imports are not the file's own callables


def test_not_callable(tmp_path):
    path = _write(tmp_path, "compute_score = 3\n")
    with pytest.raises(TypeError, match="not a function"):
        load_reward_fn(str(path))


def test_signature_that_cannot_take_four_args(tmp_path):
    path = _write(tmp_path, "def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    with pytest.raises(TypeError, match=r"extra_info=None"):
        load_reward_fn(str(path))


def test_reward_kwargs_the_function_does_not_accept(tmp_path):
    with pytest.raises(TypeError, match="bonus"):
        load_reward_fn(str(_write(tmp_path, FLOAT_FN)), reward_kwargs={"bonus": 1.0})


def test_import_error_in_the_file_is_reported_with_the_path_and_line(tmp_path):
    path = _write(tmp_path, "import os\n\nimport not_a_real_module_xyz\n")
    with pytest.raises(ImportError, match=r"my_reward\.py'.* failed at line 3 with ModuleNotFoundError: .*"
                                          r"not_a_real_module_xyz"):
        load_reward_fn(str(path))


@pytest.mark.parametrize("source", ["def compute_score(a, b\n", "raise RuntimeError('boom at import')\n",
                                    "x = 1 / 0\n", "\x00\x01 not python\n"])
def test_a_file_that_cannot_be_imported_fails_naming_it(tmp_path, source):
    """Syntax errors and exceptions at import time are reported with the file, never as a bare traceback."""
    path = _write(tmp_path, source)
    with pytest.raises(ImportError, match=r"my_reward\.py"):
        load_reward_fn(str(path))


BATCH_FN = """
    def compute_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        return [float(s == gt) + bonus for s, gt in zip(solution_strs, ground_truths)]
"""


def test_a_batch_function_is_called_by_keyword_with_its_reward_kwargs(tmp_path):
    fn = load_reward_fn(str(_write(tmp_path, BATCH_FN)), reward_kwargs={"bonus": 0.5}, batch=True)
    assert fn(data_sources=["s", "s"], solution_strs=["1", "2"], ground_truths=["1", "1"],
              extra_infos=[{}, {}]) == [1.5, 0.5]


def test_a_per_row_function_under_the_batch_manager_names_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"cannot be called as compute_score\(data_sources=..., solution_strs=..., "
                                        r"ground_truths=..., extra_infos=...\) \(as reward_model.reward_manager=batch "
                                        r"calls it, once per batch\); it scores one response per call: set "
                                        r"reward_model.reward_manager=naive"):
        load_reward_fn(str(_write(tmp_path, FLOAT_FN)), batch=True)


def test_a_batch_function_under_a_per_row_manager_names_the_fix(tmp_path):
    with pytest.raises(TypeError, match=r"it takes lists \(a whole batch\): set reward_model.reward_manager=batch"):
        load_reward_fn(str(_write(tmp_path, BATCH_FN)))


def test_a_batch_function_of_another_shape_gets_the_batch_signature(tmp_path):
    path = _write(tmp_path, "def compute_score(responses):\n    return [1.0] * len(responses)\n")
    with pytest.raises(TypeError, match=r"define it as `def compute_score\(data_sources, solution_strs, "
                                        r"ground_truths, extra_infos, \*\*kwargs\)` returning one score per row"):
        load_reward_fn(str(path), batch=True)


def test_the_batch_manager_needs_a_function_file():
    with pytest.raises(ValueError, match=r"reward_model.reward_manager=batch .* set reward_manager=naive"):
        load_reward_fn(None, batch=True)
