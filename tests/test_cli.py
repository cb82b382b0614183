"""The `lathe` command: fast failures with plain messages, --print-config, preprocess wiring."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml

from lathe.cli import main

PROBE = ("import sys; from lathe.cli import main; rc = main(sys.argv[1:]); "
         "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH'); sys.exit(rc)")


def lathe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)


def test_mistyped_key_fails_before_anything_heavy_loads():
    r = lathe("train", "algorithm.adv_estimatr=grpo")
    assert r.returncode == 2
    assert "algorithm.adv_estimator" in r.stderr and "did you mean" in r.stderr.lower()
    assert "NO_TORCH" in r.stdout          # failed inside the config layer, before torch or a model


def test_non_dividing_batch_sizes_are_explained():
    r = lathe("train", "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=48")
    assert r.returncode == 2
    assert "ppo_mini_batch_size=48" in r.stderr and "train_batch_size=64" in r.stderr
    assert "NO_TORCH" in r.stdout


def test_print_config_prints_a_loadable_resolved_tree(capsys):
    assert main(["train", "--print-config", "actor_rollout_ref.rollout.n=4"]) == 0
    tree = yaml.safe_load(capsys.readouterr().out)
    assert tree["actor_rollout_ref"]["rollout"]["n"] == 4
    assert tree["algorithm"]["adv_estimator"] == "grpo"
    assert "${" not in tree["trainer"]["default_local_dir"]     # interpolations resolved
    # keys on both sides of the flag (a launch script's keys, then `--print-config key=value` from its caller)
    assert main(["train", "base", "actor_rollout_ref.rollout.n=4", "--print-config", "actor_rollout_ref.rollout.n=6"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["actor_rollout_ref"]["rollout"]["n"] == 6
    with pytest.raises(SystemExit):
        main(["presets", "extra"])


def test_unknown_algorithm_name_fails_with_known_names(tmp_path, capsys):
    rc = main(["train", "algorithm.adv_estimator=grpoo", f"trainer.default_local_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "grpo" in err and "rloo" in err


def test_preprocess_gsm8k_command(tmp_path, capsys):
    raw = tmp_path / "train.jsonl"
    raw.write_text("\n".join(json.dumps({"question": f"What is {i}+{i}?", "answer": f"It is {2 * i}.\n#### {2 * i}"})
                             for i in range(3)) + "\n")
    assert main(["preprocess", "gsm8k", "--input", str(raw), "--output", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["0", "2", "4"]
    assert rows[1]["data_source"] == "openai/gsm8k"
    assert "train" in capsys.readouterr().out


def test_presets_are_listed(capsys):
    assert main(["presets"]) == 0
    assert "default" in capsys.readouterr().out.split()


def test_generate_mistyped_key_fails_before_anything_heavy_loads(tmp_path):
    r = lathe("generate", str(tmp_path), str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "temprature=0")
    assert r.returncode == 2
    assert "temperature" in r.stderr and "did you mean" in r.stderr.lower()
    assert "NO_TORCH" in r.stdout


def test_generate_bad_row_names_file_line_and_field_before_torch(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "fine"}\n{"prompt_token_ids": "1 2 3"}\n')
    r = lathe("generate", str(tmp_path / "model"), str(inp), str(tmp_path / "out.jsonl"), "temperature=0")
    assert r.returncode == 2
    assert f"{inp} line 2" in r.stderr and "prompt_token_ids" in r.stderr
    assert "NO_TORCH" in r.stdout


def test_generate_command_writes_one_row_per_prompt(tmp_path, caplog):
    from cli.test_generate import save_tiny_model
    model, _ = save_tiny_model(tmp_path / "model")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("1+1=", "22+3=", "7*7=")))
    with caplog.at_level("INFO", logger="lathe"):
        assert main(["generate", str(model), str(inp), str(out), "n=2", "max_tokens=5", "seed=0", "batch_size=2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["1+1=", "22+3=", "7*7="] and [r["index"] for r in rows] == [0, 1, 2]
    assert all(len(r["outputs"]) == 2 and all(1 <= len(s["token_ids"]) <= 5 for s in r["outputs"]) for r in rows)
    assert "3 prompts, 6 samples" in caplog.text and "tok/s" in caplog.text


def test_a_model_of_ones_own_without_a_preset_asks_for_one(tmp_path):
    """No preset named: the demo's settings (`default`: CPU, a supervised warm start at its own learning rate) would
    run on the user's model. Refused before anything loads, naming both presets; a warm start set explicitly, a preset
    named or a built-in model pass this check."""
    r = lathe("train", f"actor_rollout_ref.model.path={tmp_path}", "data.train_batch_size=16")
    assert r.returncode == 2 and "NO_TORCH" in r.stdout
    assert f"actor_rollout_ref.model.path={tmp_path} with no preset named" in r.stderr
    assert "no config.json" in r.stderr            # (the path's own problem, in the same message: preflight's)
    assert "trainer.device=cpu, a supervised warm start of 300 steps" in r.stderr
    assert "lathe train base key=value" in r.stderr and "lathe train default" in r.stderr
    from lathe.cli import _demo_settings_on_a_users_model as check
    check(["actor_rollout_ref.model.path=builtin:tiny"])
    check([f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.model.warm_start.steps=0"])
    check([f"++actor_rollout_ref.model.path={tmp_path}", "+actor_rollout_ref.model.warm_start.steps=50"])
    check(["trainer.total_training_steps=2"])
