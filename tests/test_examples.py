"""examples/: each launch script resolves to a valid config (its keys through load_config, with the paths from
its environment variables), refuses to start without its data, and the SLURM one hands Ray's launcher the same
keys; the tool configs of the multi-turn examples (examples/tools/) load and answer. No GPU here: the runs are
checked as `--print-config trainer.device=cpu` (the last key wins)."""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from lathe.config import load_config
from lathe.data.preprocess import PREPROCESSORS
from lathe.reward.sandbox import unavailable
from lathe.rollout.agent.parser import ToolCall
from lathe.rollout.agent.tool_config import load_tools

ROOT = Path(__file__).resolve().parents[1]
LATHE = f"{shlex.quote(sys.executable)} -m lathe"


@pytest.fixture
def data_dir(tmp_path):
    for split in ("train", "test"):
        (tmp_path / f"{split}.parquet").write_bytes(b"")     # only their existence is checked before lathe runs
    return tmp_path


def run_example(name: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LATHE": LATHE, **env}, cwd=ROOT)


@pytest.mark.parametrize("name,checks", [
    ("gsm8k_grpo_1gpu.sh", {"actor_rollout_ref.rollout.n": 5, "data.train_batch_size": 256}),
    ("qwen3_8b_gb200.sh", {"actor_rollout_ref.rollout.enforce_eager": True,
                           "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16", "trainer.n_gpus_per_node": 4}),
    ("gsm8k_multiturn_tool.sh", {"actor_rollout_ref.rollout.name": "lathe", "actor_rollout_ref.rollout.n": 16,
                                 "actor_rollout_ref.rollout.multi_turn.enable": True,
                                 "actor_rollout_ref.rollout.multi_turn.format": "hermes",
                                 "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 5,
                                 "actor_rollout_ref.rollout.multi_turn.tool_config_path":
                                     str(ROOT / "examples" / "tools" / "gsm8k_tool.yaml"),
                                 "data.max_prompt_length": 1024, "trainer.n_gpus_per_node": 8}),
    ("gsm8k_custom_agent.sh", {"actor_rollout_ref.rollout.agent.agent_loop_config_path":
                                   str(ROOT / "examples" / "agents" / "loops.yaml"),
                               "actor_rollout_ref.rollout.agent.default_agent_loop": "self_check",
                               "actor_rollout_ref.rollout.multi_turn.enable": False, "trainer.n_gpus_per_node": 1}),
    ("geo3k_qwen2_5_vl.sh", {"data.image_key": "images", "actor_rollout_ref.rollout.n": 5,
                             "actor_rollout_ref.rollout.name": "lathe", "data.max_response_length": 2048,
                             "trainer.n_gpus_per_node": 8}),
    ("geo3k_multiturn_qwen2_5_vl.sh", {"data.image_key": "images", "actor_rollout_ref.rollout.name": "lathe",
                                       "actor_rollout_ref.rollout.n": 16,
                                       "actor_rollout_ref.rollout.multi_turn.enable": True,
                                       "actor_rollout_ref.rollout.multi_turn.format": "hermes",
                                       "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 5,
                                       "actor_rollout_ref.rollout.multi_turn.tool_config_path":
                                           str(ROOT / "examples" / "tools" / "geo3k_tool.yaml"),
                                       "data.max_prompt_length": 2048, "data.max_response_length": 2048,
                                       "data.train_batch_size": 256, "trainer.n_gpus_per_node": 8}),
])
def test_a_single_node_example_resolves_to_a_valid_config(name, checks, data_dir):
    out = run_example(name, "--print-config", "trainer.device=cpu", DATA_DIR=str(data_dir), MODEL="/models/m")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["actor_rollout_ref"]["model"]["path"] == "/models/m"
    assert cfg["data"]["train_files"] == str(data_dir / "train.parquet")
    for key, want in checks.items():
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == want, (key, node)


FULLY_ASYNC_VL = "geo3k_qwen3_vl_fully_async.sh"


def _fake_nvidia_smi(tmp_path, gpus: int) -> dict:
    """Environment whose PATH finds an `nvidia-smi` listing `gpus` GPUs (and CUDA_VISIBLE_DEVICES unset)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    probe = bin_dir / "nvidia-smi"
    probe.write_text("#!/usr/bin/env bash\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n"
                                                        for i in range(gpus)))
    probe.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": ""}


def test_the_fully_async_vl_example_splits_the_nodes_gpus_between_the_pools(data_dir, tmp_path):
    cfg = _print_config(FULLY_ASYNC_VL, DATA_DIR=str(data_dir), **_fake_nvidia_smi(tmp_path, 8), TRAIN_GPUS="2",
                        ROLLOUT_GPUS="6")
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"] == "/models/m" and cfg["data"]["image_key"] == "images"
    assert (cfg["trainer"]["n_gpus_per_node"], cfg["rollout"]["n_gpus_per_node"]) == (2, 6)
    assert arr["hybrid_engine"] is False and arr["rollout"]["name"] == "lathe" and arr["rollout"]["n"] == 4
    at = cfg["async_training"]
    assert (at["staleness_threshold"], at["trigger_parameter_sync_step"], at["require_batches"],
            at["partial_rollout"], at["compute_prox_log_prob"]) == (0.1, 4, 2, True, True)
    assert cfg["data"]["train_batch_size"] == 128, "a step: require_batches x ppo_mini_batch_size prompts"
    rc = cfg["algorithm"]["rollout_correction"]
    assert (rc["rollout_is"], rc["rollout_rs"]) == ("sequence", "seq_mean_k1")
    default = _print_config(FULLY_ASYNC_VL, DATA_DIR=str(data_dir), GPUS_PER_NODE="8")      # half and half
    assert (default["trainer"]["n_gpus_per_node"], default["rollout"]["n_gpus_per_node"]) == (4, 4)


@pytest.mark.parametrize("env,message", [
    ({"TRAIN_GPUS": "4", "ROLLOUT_GPUS": "4"}, "TRAIN_GPUS=4 \\+ ROLLOUT_GPUS=4 = 8 GPUs per node, but a node has "
                                               "GPUS_PER_NODE=6"),
    ({"TRAIN_GPUS": "6"}, "ROLLOUT_GPUS=0: each pool needs at least one GPU"),
    ({"GPUS_PER_NODE": "8"}, "GPUS_PER_NODE=8, but this node shows 6 GPU"),
])
def test_the_fully_async_vl_example_refuses_a_split_the_node_cannot_hold(env, message, data_dir, tmp_path):
    out = run_example(FULLY_ASYNC_VL, DATA_DIR=str(data_dir), **_fake_nvidia_smi(tmp_path, 6), **env)
    assert out.returncode == 2 and re.search(message, out.stderr), out.stderr


def test_the_fully_async_vl_example_without_nvidia_smi_asks_for_the_gpu_count(data_dir):
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is installed here")
    out = run_example(FULLY_ASYNC_VL, DATA_DIR=str(data_dir))
    assert out.returncode == 2 and "nvidia-smi not found" in out.stderr and "GPUS_PER_NODE" in out.stderr


def test_the_sft_example_resolves_to_verls_gsm8k_sft_recipe(data_dir):
    out = run_example("gsm8k_sft.sh", "--print-config", "trainer.device=cpu", DATA_DIR=str(data_dir), MODEL="/models/m")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["path"] == "/models/m" and cfg["data"]["train_files"] == str(data_dir / "train.parquet")
    assert (cfg["data"]["prompt_dict_keys"], cfg["data"]["response_dict_keys"]) == (["question"], ["answer"])


@pytest.mark.parametrize("name", ["gsm8k_grpo_1gpu.sh", "qwen3_8b_gb200.sh", "gsm8k_grpo_slurm.sh", "gsm8k_sft.sh",
                                  "gsm8k_multiturn_tool.sh", "geo3k_qwen2_5_vl.sh", "geo3k_qwen3_vl_fully_async.sh",
                                  "geo3k_multiturn_qwen2_5_vl.sh", "gsm8k_custom_agent.sh"])
def test_an_example_without_its_data_says_how_to_make_it(name, tmp_path):
    out = run_example(name, DATA_DIR=str(tmp_path / "nowhere"), SBATCH="false")
    assert out.returncode == 2 and "train.parquet" in out.stderr and "DATA_DIR" in out.stderr


def test_the_slurm_example_hands_the_launcher_valid_keys_and_sets_rocm_variables(data_dir, tmp_path):
    probe = tmp_path / "sbatch"                 # stands in for sbatch: prints what it was given
    probe.write_text(f"#!{sys.executable}\nimport os, sys\nprint(repr(sys.argv[1:]))\n"
                     "print(os.environ.get('HIP_VISIBLE_DEVICES'), os.environ.get('ROCR_VISIBLE_DEVICES'))\n")
    probe.chmod(0o755)
    out = run_example("gsm8k_grpo_slurm.sh", "trainer.total_epochs=1", DATA_DIR=str(data_dir), NNODES="2",
                      GPUS_PER_NODE="4", ROCM="1", ROCR_VISIBLE_DEVICES="0,1", SBATCH=str(probe))
    assert out.returncode == 0, out.stderr
    argv_line, env_line = out.stdout.strip().splitlines()
    argv = eval(argv_line)                     # noqa: S307 - the repr of a list of strings printed just above
    assert argv[:3] == ["--nodes=2", "--gpus-per-node=4", "--export=ALL"]
    assert argv[3].endswith("scripts/slurm_ray.sbatch") and argv[4] == "base"
    assert env_line == "0,1,2,3 None", "ROCm: HIP_VISIBLE_DEVICES for the node's GPUs, ROCR_VISIBLE_DEVICES unset"
    overrides = argv[5:] + ["trainer.device=cpu", "trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    cfg = load_config("base", overrides)       # the launcher adds trainer.nnodes / n_gpus_per_node
    assert cfg.trainer.total_epochs == 1 and cfg.data.train_batch_size == 1024


def _print_config(name: str, *args: str, **env) -> dict:
    out = run_example(name, "--print-config", "trainer.device=cpu", *args, MODEL="/models/m", **env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_the_multiturn_tool_example_runs_on_one_gpu_with_a_smaller_model(data_dir):
    cfg = _print_config("gsm8k_multiturn_tool.sh", DATA_DIR=str(data_dir), GPUS="1")
    assert cfg["trainer"]["n_gpus_per_node"] == 1 and cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"]


@pytest.fixture
def math_data_dir(tmp_path):
    for name in ("math500", "aime24"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "test.parquet").write_bytes(b"")     # only their existence is checked before lathe runs
    return tmp_path


def test_the_code_interpreter_example_resolves_to_a_retool_style_config(math_data_dir):
    cfg = _print_config("code_interpreter_math.sh", DATA_DIR=str(math_data_dir))
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"] == "/models/m"
    assert cfg["data"]["train_files"] == str(math_data_dir / "math500" / "test.parquet")
    assert cfg["data"]["val_files"] == str(math_data_dir / "aime24" / "test.parquet")
    mt = arr["rollout"]["multi_turn"]
    assert (mt["enable"], mt["format"], mt["max_assistant_turns"], mt["max_user_turns"]) == (True, "hermes", 16, 16)
    assert mt["tool_config_path"] == str(ROOT / "examples" / "tools" / "code_interpreter.yaml")
    assert arr["rollout"]["name"] == "lathe" and arr["rollout"]["n"] == 16 and arr["rollout"]["val_kwargs"]["n"] == 30
    assert (arr["actor"]["clip_ratio_low"], arr["actor"]["clip_ratio_high"], arr["actor"]["use_kl_loss"]) == \
        (0.2, 0.28, False)


def test_the_code_interpreter_example_takes_other_data_files(math_data_dir):
    train = math_data_dir / "mine.parquet"
    train.write_bytes(b"")
    cfg = _print_config("code_interpreter_math.sh", DATA_DIR=str(math_data_dir), TRAIN_FILE=str(train))
    assert cfg["data"]["train_files"] == str(train)


def test_the_code_interpreter_example_without_its_data_says_how_to_make_it(tmp_path):
    out = run_example("code_interpreter_math.sh", DATA_DIR=str(tmp_path / "nowhere"))
    assert out.returncode == 2
    assert "lathe preprocess math500" in out.stderr and "DATA_DIR" in out.stderr and "TRAIN_FILE" in out.stderr


def test_the_gsm8k_tool_config_scores_a_preprocessed_row(tmp_path):
    raw = tmp_path / "test.jsonl"
    raw.write_text('{"question": "2 + 40?", "answer": "2+40=42\\n#### 42"}\n')
    (row,) = pq.read_table(PREPROCESSORS["gsm8k_tool"](str(raw), str(tmp_path / "out"))["test"]).to_pylist()
    tools = load_tools(ROOT / "examples" / "tools" / "gsm8k_tool.yaml")
    assert list(tools.tools) == ["calc_gsm8k_reward", "calculator"]
    params = tools.schemas()[0]["function"]["parameters"]
    assert params["required"] == ["answer"] and params["properties"]["answer"]["type"] == "string"
    session = tools.open("t0", row["extra_info"]["tools_kwargs"])
    result = session.call(ToolCall("calc_gsm8k_reward", {"answer": "42"}), timeout_s=30)
    assert not result.error and session.rewards() == {"calc_gsm8k_reward": 1.0}
    assert session.call(ToolCall("calculator", {"expression": "6*7"}), timeout_s=30).text == "42"
    session.close()


def test_the_geo3k_multiturn_example_names_the_preprocess_command_and_runs_on_fewer_gpus(data_dir, tmp_path):
    out = run_example("geo3k_multiturn_qwen2_5_vl.sh", DATA_DIR=str(tmp_path / "nowhere"))
    assert out.returncode == 2 and "lathe preprocess geo3k_tool" in out.stderr
    cfg = _print_config("geo3k_multiturn_qwen2_5_vl.sh", DATA_DIR=str(data_dir), GPUS="4")
    assert cfg["trainer"]["n_gpus_per_node"] == 4 and cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["enable"]


def test_the_geo3k_tool_config_scores_a_preprocessed_row(tmp_path):
    image = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 120, 240)).save(image, format="PNG")
    raw = tmp_path / "geometry3k" / "data"                               # a local copy of hiyouga/geometry3k
    raw.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"images": [{"bytes": image.getvalue(), "path": None}],
                                          "problem": "<image>Find x.", "answer": "3"}]),
                   str(raw / "test-00000-of-00001.parquet"))
    out = PREPROCESSORS["geo3k_tool"](str(raw.parent), str(tmp_path / "out"))
    (row,) = pq.read_table(out["test"]).to_pylist()
    tools = load_tools(ROOT / "examples" / "tools" / "geo3k_tool.yaml")
    assert list(tools.tools) == ["calc_geo3k_reward"]
    assert type(tools.tools["calc_geo3k_reward"]).__name__ == "Geo3kTool", "verl's class path runs lathe's built-in"
    params = tools.schemas()[0]["function"]["parameters"]
    assert params["required"] == ["answer"] and params["properties"]["answer"]["type"] == "string"
    session = tools.open("t0", row["extra_info"]["tools_kwargs"])
    wrong = session.call(ToolCall("calc_geo3k_reward", {"answer": "4"}), timeout_s=30)
    right = session.call(ToolCall("calc_geo3k_reward", {"answer": "\\boxed{3}"}), timeout_s=30)
    assert (wrong.reward, right.reward) == (-0.05, 0.0) and not right.error
    assert session.rewards() == {"calc_geo3k_reward": 1.0}
    session.close()


def test_the_code_interpreter_tool_config_runs_python():
    if reason := unavailable():
        pytest.skip(f"the local sandbox cannot run here: {reason}")
    tools = load_tools(ROOT / "examples" / "tools" / "code_interpreter.yaml")
    assert list(tools.tools) == ["code_interpreter"]
    assert tools.schemas()[0]["function"]["parameters"]["required"] == ["code"]
    session = tools.open("t0")
    result = session.call(ToolCall("code_interpreter", {"code": "print(6 * 7)"}), timeout_s=30)
    session.close()
    assert not result.error and result.text.strip() == "42"
