"""bench/fully_async.py builds its two `lathe train` command lines from bench/e2e.py's: an argument e2e gained later
(`--profile-step`) once broke it on the GPU machine before either run started. The bench is imported in a child
process, with bench/ on its path as when it runs, so nothing imported by the suite stands in for its modules."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fully_async
args = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--trigger", "3",
                               "--extra", "actor_rollout_ref.nccl_timeout=120"])
paths = {key: Path(sys.argv[2]) / key for key in ("model", "tokenizer", "parquet", "reward", "run")}
print(json.dumps(fully_async.commands(paths, args)))
"""


def test_fully_async_builds_both_command_lines(tmp_path):
    done = subprocess.run([sys.executable, "-c", BUILD, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    cmds = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(cmds) == {"sync", "async"}
    for cmd in cmds.values():
        assert cmd[1:4] == ["-m", "lathe", "train"]
        assert "actor_rollout_ref.rollout.ignore_eos=false" in cmd          # the long tail needs EOS honoured
        assert "actor_rollout_ref.nccl_timeout=120" in cmd
        assert not any(c.startswith("global_profiler.") for c in cmd)
    assert cmds["sync"][-2:] == ["trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path / 'run' / 'sync'}"]
    assert {"trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
            "async_training.trigger_parameter_sync_step=3"} <= set(cmds["async"])
