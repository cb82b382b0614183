"""`lathe train` / `lathe sft` refuse a bad model path, data file, data column or reward function before anything
loads (lathe.loop.preflight): one paragraph naming the key, the file and the fix, no traceback, torch not imported."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lathe.cli import main
from lathe.config import load_config
from lathe.loop.preflight import preflight
from lathe.reward import default_compute_score

PROBE = ("import sys, time; t = time.perf_counter(); from lathe.cli import main; rc = main(sys.argv[1:]); "
         "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH'); "
         "print(f'SECONDS_TO_ERROR {time.perf_counter() - t:.2f}'); sys.exit(rc)")
ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
       "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}


def lathe_process(*args: str) -> subprocess.CompletedProcess:
    """`lathe ARGS` in a fresh interpreter; its stdout ends with whether torch was imported and the seconds taken
    (reported, not asserted: this machine is shared)."""
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    print(r.stdout.strip().splitlines()[-1])
    return r


def parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def error_of(capsys, *args: str) -> str:
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("lathe: error: ") and "Traceback" not in err
    return err


def test_a_bad_model_path_fails_before_torch_is_imported(tmp_path):
    r = lathe_process("train", f"actor_rollout_ref.model.path={tmp_path / 'no_model'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"actor_rollout_ref.model.path='{tmp_path / 'no_model'}': no such directory. Fix:" in r.stderr
    assert "NO_TORCH" in r.stdout


def test_a_missing_data_column_fails_before_torch_is_imported(tmp_path):
    data = parquet(tmp_path / "d.parquet", [{k: v for k, v in ROW.items() if k != "prompt"} | {"question": "1+1?"}])
    r = lathe_process("train", f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (f"{data} (data.train_files): field 'prompt': missing (the file's columns ['ability', 'data_source', "
            "'extra_info', 'question', 'reward_model']). Fix: add the prompt messages, or set data.prompt_key") in r.stderr
    assert "NO_TORCH" in r.stdout


def test_sft_checks_its_columns_before_torch_is_imported(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    r = lathe_process("sft", f"data.train_files={data}", "data.val_files=null")
    assert r.returncode == 2
    assert f"{data} (data.train_files): no 'prompt' column for the prompt (the first row's keys ['answer', " in r.stderr
    assert "NO_TORCH" in r.stdout


def test_every_problem_is_listed_at_once(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("import os\nimport not_a_module_xyz\n")
    err = error_of(capsys, "train", "actor_rollout_ref.model.path=builtin:huge", f"data.val_files={tmp_path / 'v.jsonl'}",
                   f"reward.custom_reward_function.path={reward}")
    assert "3 problems found before loading anything:\n  1. actor_rollout_ref.model.path: unknown built-in model" in err
    assert f"\n  2. data.val_files: data file not found: {tmp_path / 'v.jsonl'}. Fix: check the path" in err
    assert (f"\n  3. reward.custom_reward_function.path='{reward}': importing the file failed at line 2 with "
            "ModuleNotFoundError: No module named 'not_a_module_xyz'; fix the file") in err


def test_a_data_source_without_a_scorer_needs_a_reward_function(tmp_path, capsys):
    data = parquet(tmp_path / "d.parquet", [ROW, {**ROW, "data_source": "my/task"}])
    err = error_of(capsys, "train", f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1")
    assert (f"{data} (data.train_files): no built-in reward function for data_source='my/task'" in err
            and "reward.custom_reward_function.path=" in err)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    cfg = load_config(None, [f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1",
                             f"reward.custom_reward_function.path={reward}"])
    assert preflight(cfg).reward_fn("my/task", "x", "y") == 1.0


def test_a_reward_file_without_the_function_names_what_it_has(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_scor(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    err = error_of(capsys, "train", f"reward.custom_reward_function.path={reward}")
    assert "has no function 'compute_score'" in err and "Did you mean 'compute_scor'?" in err
    err = error_of(capsys, "train", f"custom_reward_function.path={tmp_path / 'none.py'}")    # verl's spelling
    assert f"reward.custom_reward_function.path='{tmp_path / 'none.py'}' does not exist" in err


def test_the_critic_model_path_is_checked_when_a_critic_trains(tmp_path):
    overrides = ["algorithm.adv_estimator=gae", f"critic.model.path={tmp_path}"]
    with pytest.raises(ValueError, match=rf"critic.model.path='{tmp_path}' has no config.json"):
        preflight(load_config(None, overrides))
    preflight(load_config(None, [*overrides[1:], "critic.enable=false"]))    # no critic: its path is not read


def test_the_default_run_passes_with_the_builtin_scorers():
    assert preflight(load_config(None, [])).reward_fn is default_compute_score


def test_the_reward_file_is_imported_once_by_lathe_train(tmp_path, monkeypatch, capsys):
    from lathe.loop import setup
    count = tmp_path / "imports"
    reward = tmp_path / "reward.py"
    reward.write_text(f"open({str(count)!r}, 'a').write('x')\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")

    def stop(*args, **kwargs):
        raise ValueError("stopped before the tokenizer")

    monkeypatch.setattr(setup, "load_tokenizer", stop)
    err = error_of(capsys, "train", f"reward.custom_reward_function.path={reward}",
                   f"trainer.default_local_dir={tmp_path / 'run'}")
    assert "stopped before the tokenizer" in err
    assert count.read_text() == "x"


def test_a_resume_path_that_is_no_checkpoint_fails_first(tmp_path, capsys):
    for command in ("train", "sft"):
        err = error_of(capsys, command, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}")
        assert f"trainer.resume_from_path='{tmp_path}' is not a checkpoint directory (it must hold trainer_state.pt" in err


def test_teachers_are_checked_before_anything_loads(tmp_path, capsys):
    data = parquet(tmp_path / "d.parquet", [ROW, {**ROW, "data_source": "math/other"}])
    teacher, reward = "distillation.teacher_models", tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    err = error_of(capsys, "train", f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1",
                   f"reward.custom_reward_function.path={reward}",
                   "distillation.enabled=true", f"+{teacher}.gsm8k.key=openai/gsm8k",
                   f"+{teacher}.gsm8k.model_path=builtin:tiny", f"+{teacher}.geo.key=hiyouga/geometry3k",
                   f"+{teacher}.geo.model_path={tmp_path / 'nowhere'}")
    assert f"{teacher}.geo.model_path" in err and str(tmp_path / "nowhere") in err
    assert (f"{data} (data.train_files): rows with data_source ['math/other'] have no teacher" in err
            and "Fix: add a teacher per data_source" in err)


def test_a_missing_reward_fn_key_column_fails_before_anything_loads(tmp_path, capsys):
    data = parquet(tmp_path / "d.parquet", [ROW])
    err = error_of(capsys, "train", f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1",
                   "data.reward_fn_key=task")
    assert (f"{data} (data.train_files): field 'task': missing (the file's columns ['ability', 'data_source', "
            "'extra_info', 'prompt', 'reward_model']). Fix: data.reward_fn_key='task' names the column") in err


def test_the_built_in_scorers_are_chosen_by_the_reward_fn_key_column(tmp_path, capsys):
    data = parquet(tmp_path / "d.parquet", [{**ROW, "data_source": "my/task", "task": "openai/gsm8k",
                                             "skill": "my/skill"}])
    base = ["train", f"data.train_files={data}", "data.val_files=null", "trainer.test_freq=-1"]
    assert "no built-in reward function for data_source='my/task'" in error_of(capsys, *base)
    preflight(load_config(None, [*base[1:], "data.reward_fn_key=task"]))      # scored by gsm8k's rule
    err = error_of(capsys, *base, "data.reward_fn_key=skill")
    assert "no built-in reward function for data_source='my/skill'" in err


def test_the_batch_manager_loads_a_batch_function_with_both_sets_of_arguments(tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos, tag, bonus):\n"
                      "    return [bonus] * len(solution_strs)\n")
    batch = ["reward_model.reward_manager=batch", f"reward.custom_reward_function.path={reward}"]
    fn = preflight(load_config(None, [*batch, "+reward_model.reward_kwargs.tag=x", "+reward.reward_kwargs.bonus=2"]
                               )).reward_fn
    assert fn.batch and fn.reward_kwargs == {"tag": "x", "bonus": 2}
    assert fn(data_sources=["a"], solution_strs=["b"], ground_truths=["c"], extra_infos=[{}]) == [2]
    err = error_of(capsys, "train", f"reward.custom_reward_function.path={reward}")
    assert "it takes lists (a whole batch): set reward_model.reward_manager=batch" in err
