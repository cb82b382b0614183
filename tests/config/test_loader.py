"""Tests for lathe.config.loader: sources, presets, overrides, round trip, and no heavy imports."""

import builtins
import io
import socket
import subprocess
import sys

import pytest

from lathe.config import ConfigError, describe_preset, list_presets, load_config, to_dict, to_yaml


def test_presets_listed():
    assert {"base", "default", "gsm8k_grpo"} <= set(list_presets())
    for name in list_presets():                     # `lathe presets` says what each is, in one line
        assert describe_preset(name).endswith("."), name


@pytest.mark.parametrize("name", list_presets())
def test_each_preset_loads_and_validates(name):
    cfg = load_config(name)
    assert cfg.data.train_batch_size % cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 0


def test_none_means_default_preset_with_builtin_run():
    cfg = load_config()
    assert cfg.data.train_files == "builtin:arithmetic" and cfg.actor_rollout_ref.model.path == "builtin:tiny"
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 8
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size) == (32, 16)
    assert cfg.trainer.device == "cpu" and cfg.actor_rollout_ref.model.warm_start.steps > 0
    assert cfg.trainer.default_local_dir == f"checkpoints/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"


def test_agent_demo_preset_runs_the_builtin_tool_task_with_no_files():
    cfg = load_config("agent_demo")
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.tool_config_path == "builtin:secret_lookup"
    assert cfg.data.train_files == cfg.data.val_files == "builtin:secret_lookup"
    assert cfg.reward.custom_reward_function.path is None                   # the built-in scorer of its data_source
    assert cfg.actor_rollout_ref.model.path == "builtin:tiny" and cfg.actor_rollout_ref.model.warm_start.steps > 0
    assert cfg.trainer.device == "cpu" and cfg.trainer.experiment_name == "builtin_agent"


def test_gsm8k_preset_mirrors_verl_example():
    cfg = load_config("gsm8k_grpo", device_count=8)
    assert cfg.data.train_files.endswith("gsm8k/train.parquet")
    assert cfg.actor_rollout_ref.rollout.n == 5 and cfg.actor_rollout_ref.actor.use_kl_loss is True


def test_overrides_apply_over_preset():
    cfg = load_config("default", ["actor_rollout_ref.rollout.n=4", "trainer.logger=[console]",
                                  "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.trainer.logger == ["console"]
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)


def test_yaml_file_over_dataclass_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  adv_estimator: grpo\ndata:\n  train_batch_size: 512\ntrainer:\n  test_freq: -1\n")
    cfg = load_config(str(path))
    assert cfg.data.train_batch_size == 512
    assert cfg.actor_rollout_ref.rollout.n == 1  # dataclass default, not the default preset's 8


def test_yaml_file_over_named_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: default\ntrainer:\n  experiment_name: mine\n")
    cfg = load_config(path)
    assert cfg.actor_rollout_ref.rollout.n == 8 and cfg.trainer.experiment_name == "mine"
    assert cfg.trainer.default_local_dir.endswith("/mine")


def test_yaml_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_sise: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert "bad.yaml" in str(err.value) and "data.train_batch_size" in str(err.value)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(path))
    path.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="Cannot parse YAML"):
        load_config(str(path))


def test_preset_loop_detected(tmp_path):
    (tmp_path / "a.yaml").write_text("preset: b.yaml\n")
    (tmp_path / "b.yaml").write_text("preset: a.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(str(tmp_path / "a.yaml"))


def test_unknown_source_suggests_preset():
    with pytest.raises(ConfigError, match="Did you mean `gsm8k_grpo`"):
        load_config("gsm8k_grp")


@pytest.mark.parametrize("name", ["default", "gsm8k_grpo"])
def test_to_yaml_round_trips(tmp_path, name):
    cfg = load_config(name, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.experiment_name=0.10",
                             "+actor_rollout_ref.model.override_config.attention_dropout=0."])
    path = tmp_path / "dump.yaml"
    path.write_text(to_yaml(cfg))
    assert to_dict(load_config(str(path))) == to_dict(cfg)


def test_import_and_load_do_not_pull_torch():
    code = ("import sys, lathe.config as c; c.load_config(); c.load_config('gsm8k_grpo'); "
            "bad = [m for m in ('torch', 'transformers', 'numpy', 'pyarrow') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_load_reads_each_preset_once_and_starts_no_process_or_connection(monkeypatch):
    """What keeps loading fast, besides importing no torch (above): it reads each YAML file of the preset chain once
    and nothing else, runs no command (nvidia-smi: rules count GPUs from /proc and /dev) and opens no connection."""
    load_config()                                       # imports done
    read = []
    real_open = io.open

    def recording_open(file, *args, **kwargs):
        read.append(str(file))
        return real_open(file, *args, **kwargs)

    def refuse(what):
        def fail(*args, **kwargs):
            done.append(f"{what}: {args[1:2]}")
            raise OSError(what)                         # recorded, so an `except` around the call cannot hide it
        return fail

    done = []
    monkeypatch.setattr(io, "open", recording_open)
    monkeypatch.setattr(builtins, "open", recording_open)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("started a process"))
    monkeypatch.setattr(socket.socket, "connect", refuse("opened a connection"))
    load_config("gsm8k_grpo")
    assert done == []
    assert read and all(p.endswith(".yaml") for p in read), read
    assert len(read) == len(set(read)), f"a preset file was read more than once: {read}"
