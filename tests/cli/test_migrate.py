"""`lathe migrate` on three launch scripts in verl's style (tests/cli/scripts/): the verdict of each key, the notes,
the lathe command it prints, and its exit status."""

from __future__ import annotations

import io
from pathlib import Path

from lathe.cli.migrate import migrate
from lathe.config import load_config

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run(name: str, **env: str) -> tuple[int, dict[str, str], str]:
    out = io.StringIO()
    code = migrate(str(SCRIPTS / name), env={"HOME": "/home/u", **env}, out=out)
    text = out.getvalue()
    rows = {}
    for line in text.split("\n\n")[0].splitlines()[1:]:
        key, _, rest = line.strip().partition(" ")
        rows[key] = rest.strip()
    return code, rows, text


def command(text: str) -> list[str]:
    block = text.split("The lathe command", 1)[1].split("\n\n")[0].splitlines()[1:]
    return [line.strip().rstrip("\\").strip() for line in block]


def test_an_fsdp_grpo_script_moves_over_as_it_is():
    code, rows, text = run("grpo_fsdp.sh")
    assert code == 0, text
    assert rows["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].split() == ["6144", "acts"]
    assert rows["actor_rollout_ref.actor.fsdp_config.param_offload"].split() == ["False", "acts"]   # case gpu)
    assert "acts as: `actor_rollout_ref.actor.ulysses_sequence_parallel_size`" in \
        rows["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"]
    assert "no effect" in rows["actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache"]
    assert "$(date +%Y%m%d) is not run here" in text
    lines = command(text)
    assert lines[0] == "lathe train base" and len(lines) == 1 + 19
    assert "\"data.train_files=['/home/u/data/gsm8k/train.parquet']\"" in lines
    assert '"trainer.experiment_name=qwen3_8b_$(date +%Y%m%d)"' in lines          # the user's shell runs it
    assert not any("engine_kwargs" in line for line in lines)
    assert run("grpo_fsdp.sh", DEVICE="npu")[1]["actor_rollout_ref.actor.fsdp_config.param_offload"].startswith(
        "True")


def test_a_megatron_script_translates_its_backend_keys_and_keeps_its_tensor_parallel_rollout():
    code, rows, text = run("ppo_megatron.sh")
    assert code == 0 and "Not ready" not in text, text
    assert "acts as: `actor_rollout_ref.actor.fsdp_config.param_offload`=true" in \
        rows["actor_rollout_ref.actor.megatron.param_offload"]
    assert "acts as: `actor_rollout_ref.model.enable_gradient_checkpointing`=true" in \
        rows["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity"]
    assert "runs on lathe's FSDP2 trainer" in rows["actor_rollout_ref.actor.strategy"]
    assert rows["actor_rollout_ref.rollout.tensor_model_parallel_size"].split() == ["2", "acts"]
    assert "--config-name=ppo_megatron_trainer.yaml: not needed" in text
    lines = command(text)
    assert "actor_rollout_ref.actor.megatron.param_offload=True" in lines
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" in lines
    assert not any(line.startswith(("2>", "tee")) for line in lines)


def test_a_fully_async_script_and_a_variable_it_never_sets():
    code, rows, text = run("fully_async.sh")
    assert "fully async: lathe runs its fully-async loop" in text
    assert "${DATA_DIR} is never set in the script" in text
    assert code == 0 and "the whole config" not in text, text      # an unset variable is not a config reference
    assert '"data.train_files=${DATA_DIR}/train.parquet"' in command(text)
    code, rows, text = run("fully_async.sh", DATA_DIR="/data", NGPUS_TRAIN="2")
    assert code == 0, text
    assert rows["trainer.n_gpus_per_node"].split() == ["2", "acts"]
    assert rows["actor_rollout_ref.rollout.name"].startswith("vllm") and "lathe's engine in vllm's place" in \
        rows["actor_rollout_ref.rollout.name"]
    assert all(v.split()[-1] == "acts" for k, v in rows.items() if k != "actor_rollout_ref.rollout.name"), rows


def test_megatron_block_recompute_moves_over_as_lathes_count(tmp_path):
    """The block method's keys act together, through the pipeline stages (whose key has no effect of its own and is
    left out): the command carries the count they give, and loads with it."""
    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    script = tmp_path / "block.sh"
    script.write_text("python3 -m verl.trainer.main_ppo \\\n    actor_rollout_ref.actor.megatron.pipeline_model_"
                      f"parallel_size=2 \\\n    +{otc}.recompute_granularity=full \\\n    +{otc}.recompute_method=block"
                      f" \\\n    +{otc}.recompute_num_layers=4 \\\n    trainer.n_gpus_per_node=2\n")
    out = io.StringIO()
    assert migrate(str(script), env={}, out=out) == 0, out.getvalue()
    text = out.getvalue()
    rows = {line.split()[0]: line for line in text.split("\n\n")[0].splitlines()[1:]}
    assert "acts as: `actor_rollout_ref.model.gradient_checkpointing_layers`=8" in rows[f"{otc}.recompute_num_layers"]
    assert "acts as" in rows[f"{otc}.recompute_method"]
    lines = command(text)
    assert "actor_rollout_ref.model.gradient_checkpointing_layers=8" in lines
    assert load_config("base", lines[1:], device_count=2).actor_rollout_ref.model.gradient_checkpointing_layers == 8


def test_an_sft_script_becomes_a_lathe_sft_command_with_torchruns_devices():
    code, _, text = run("sft_fsdp.sh")
    assert code == 0, text
    lines = command(text)
    assert lines[0] == "lathe sft" and "engine=fsdp" in lines and "trainer.n_gpus_per_node=4" in lines
    assert "trainer.nnodes=1" not in lines                          # one node: lathe sft's default
    assert "trainer.n_gpus_per_node=4: from the launcher's torchrun flags" in text
    code, _, text = run("sft_fsdp.sh", SP="2")
    assert code == 1 and "Not ready: lathe sft stops on" in text and "Ulysses sequence parallelism in lathe sft" in text
