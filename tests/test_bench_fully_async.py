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
tool = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--workload", "tool", "--turns", "3"])
tp = fully_async.parse_args(["--device", "cpu", "--shape", "tiny", "--workload", "tool", "--rollout-tp", "2"])
tool_paths = {**paths, "tool": fully_async.write_tool(Path(sys.argv[2]), tool)}
sys.path.insert(0, sys.argv[2])
import bench_sleep_tool
from lathe.rollout.agent.parser import get_parser
calls = get_parser("hermes")("any text").calls
steps = [{"perf/time_per_step": 9.0, "trainer/idle_ratio": 0.5}, {"perf/time_per_step": 2.0, "trainer/idle_ratio": 0.25},
         {"perf/time_per_step": 4.0, "trainer/idle_ratio": 0.5}]
print(json.dumps({"plain": fully_async.commands(paths, args), "tool": fully_async.commands(tool_paths, tool),
                  "tp": fully_async.commands(tool_paths, tp),
                  "calls": [c.name for c in calls], "busy": fully_async.summarize(steps, 1)["trainer_busy_s"]}))
"""


def test_fully_async_builds_both_command_lines(tmp_path):
    done = subprocess.run([sys.executable, "-c", BUILD, str(ROOT / "bench"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    built = json.loads(done.stdout.strip().splitlines()[-1])
    cmds = built["plain"]
    assert set(cmds) == {"sync", "async"}
    for cmd in cmds.values():
        assert cmd[1:4] == ["-m", "lathe", "train"]
        assert "actor_rollout_ref.rollout.ignore_eos=false" in cmd          # the long tail needs EOS honoured
        assert "actor_rollout_ref.nccl_timeout=120" in cmd
        assert not any(c.startswith("global_profiler.") for c in cmd)
    assert cmds["sync"][-2:] == ["trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path / 'run' / 'sync'}"]
    assert {"trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
            "async_training.trigger_parameter_sync_step=3"} <= set(cmds["async"])
    # --workload tool: both runs multi-turn with the bench's tool, whose module makes every turn call it
    mt = "actor_rollout_ref.rollout.multi_turn"
    for cmd in built["tool"].values():
        assert {f"{mt}.enable=true", f"{mt}.max_assistant_turns=3",
                f"{mt}.tool_config_path={tmp_path / 'bench_sleep_tool.json'}"} <= set(cmd)
    assert not any(c.startswith(f"{mt}.") for c in cmds["async"]) and built["calls"] == ["sleep"]
    assert abs(built["busy"] - (2.0 * 0.75 + 4.0 * 0.5)) < 1e-9     # the timed steps' trainer-busy seconds
    # --rollout-tp 2: tensor-parallel replicas (sync: one of the 2 GPUs; async: a pool of 2 beside the trainer's)
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    assert not any(c.startswith(tp) for cmd in built["tool"].values() for c in cmd)
    assert f"{tp}=2" in built["tp"]["sync"] and {f"{tp}=2", "rollout.n_gpus_per_node=2"} <= set(built["tp"]["async"])
