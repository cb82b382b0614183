"""bench/fully_async.py builds its two `lathe train` command lines from bench/e2e.py's: an argument e2e gained later
(`--profile-step`) once broke it on the GPU machine before either run started."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fully_async_builds_both_command_lines(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import fully_async
    args = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--trigger", "3",
                                   "--extra", "actor_rollout_ref.nccl_timeout=120"])
    paths = {key: tmp_path / key for key in ("model", "tokenizer", "parquet", "reward", "run")}
    cmds = fully_async.commands(paths, args)
    assert set(cmds) == {"sync", "async"}
    for cmd in cmds.values():
        assert cmd[1:4] == ["-m", "lathe", "train"]
        assert "actor_rollout_ref.rollout.ignore_eos=false" in cmd          # the long tail needs EOS honoured
        assert not any(c.startswith("global_profiler.") for c in cmd)
        assert "actor_rollout_ref.nccl_timeout=120" in cmd
    assert cmds["sync"][-2:] == ["trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path / 'run' / 'sync'}"]
    assert {"trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
            "async_training.trigger_parameter_sync_step=3"} <= set(cmds["async"])
