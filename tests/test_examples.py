"""examples/: each launch script resolves to a valid config (its keys through load_config, with the paths from
its environment variables), refuses to start without its data, and the SLURM one hands Ray's launcher the same
keys. No GPU here: the runs are checked as `--print-config trainer.device=cpu` (the last key wins)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lathe.config import load_config

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


def test_the_sft_example_resolves_to_verls_gsm8k_sft_recipe(data_dir):
    out = run_example("gsm8k_sft.sh", "--print-config", "trainer.device=cpu", DATA_DIR=str(data_dir), MODEL="/models/m")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["model"]["path"] == "/models/m" and cfg["data"]["train_files"] == str(data_dir / "train.parquet")
    assert (cfg["data"]["prompt_dict_keys"], cfg["data"]["response_dict_keys"]) == (["question"], ["answer"])


@pytest.mark.parametrize("name", ["gsm8k_grpo_1gpu.sh", "qwen3_8b_gb200.sh", "gsm8k_grpo_slurm.sh", "gsm8k_sft.sh"])
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
