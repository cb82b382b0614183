"""lathe.cli.shell reads a launch script's trainer call without running it (bash's results, worked out by hand)."""

import pytest

from lathe.cli.shell import ShellError, read_script

TRAINER = "verl.trainer.main_ppo"


def args_of(text: str, env=None) -> list[str]:
    return read_script(text, env or {}).args


def test_variables_defaults_and_arithmetic():
    script = r"""#!/usr/bin/env bash
set -xeuo pipefail
lr=${LR:-1e-6}
max_prompt_length=$((1024 * 2))
max_response_length=$(( 1024 * 8 ))
len=$(((max_prompt_length + max_response_length) / 4))
name="run_${lr}"
python3 -m verl.trainer.main_ppo \
    actor_rollout_ref.actor.optim.lr=$lr \
    data.max_prompt_length=${max_prompt_length} \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$len \
    trainer.experiment_name="$name" $@
"""
    assert args_of(script) == ["actor_rollout_ref.actor.optim.lr=1e-6", "data.max_prompt_length=2048",
                               "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2560",
                               "trainer.experiment_name=run_1e-6"]
    assert args_of(script, {"LR": "3e-6"})[0] == "actor_rollout_ref.actor.optim.lr=3e-6"


def test_arrays_quotes_and_word_splitting():
    script = """
TRAIN="$HOME/data/gsm8k/train.parquet"
files="['$TRAIN', '/x/math.parquet']"
DATA=(
    data.train_files="$files"
    data.truncation='error'   # a comment
)
DATA+=(data.seed=1)
EXTRA="trainer.nnodes=1 trainer.n_gpus_per_node=8"
python3 -m verl.trainer.main_ppo "${DATA[@]}" $EXTRA 'trainer.logger=["console"]' "$@" 2>&1 | tee log.txt
"""
    assert args_of(script, {"HOME": "/home/u"}) == [
        "data.train_files=['/home/u/data/gsm8k/train.parquet', '/x/math.parquet']", "data.truncation=error",
        "data.seed=1", "trainer.nnodes=1", "trainer.n_gpus_per_node=8", 'trainer.logger=["console"]']


def test_branches_follow_the_environment():
    script = """
DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
case "${DEVICE}" in
    gpu)
        offload=False
        ;;
    npu | ascend) offload=True ;;
    *) echo bad; exit 1 ;;
esac
if [ "${VERL_USE_UV:-1}" != 0 ] && [ "${DEVICE:-gpu}" = gpu ] && { [ "${BACKEND:-vllm}" = vllm ] || [ x = y ]; }; then
    LAUNCH=(uv run python3)
else
    LAUNCH=(python3)
fi
pp=${PP:-1}
[ "${pp}" -gt 1 ] && vpp=2 || vpp=null
"${LAUNCH[@]}" -m verl.trainer.main_ppo actor.offload=$offload vpp=$vpp launch=${LAUNCH[0]}
"""
    assert args_of(script, {"DEVICE": "gpu", "VERL_USE_UV": "0"}) == ["actor.offload=False", "vpp=null",
                                                                      "launch=python3"]
    assert args_of(script, {"DEVICE": "npu", "PP": "2"}) == ["actor.offload=True", "vpp=2", "launch=python3"]
    assert args_of(script, {"DEVICE": "gpu"}) == ["actor.offload=False", "vpp=null", "launch=uv"]


def test_unset_variables_and_commands_are_reported_not_run():
    script = """
set -u
python3 -m verl.trainer.main_ppo trainer.default_local_dir=$CKPT_DIR/x \\
    trainer.experiment_name=run_$(date +%Y%m%d) &
"""
    found = read_script(script, {})
    assert found.args == ["trainer.default_local_dir=${CKPT_DIR}/x", "trainer.experiment_name=run_$(date +%Y%m%d)"]
    assert found.unresolved == ["CKPT_DIR"] and found.commands == ["$(date +%Y%m%d)"]
    assert found.module == TRAINER and found.line == 3


def test_functions_and_loops_are_skipped_and_fully_async_is_found():
    script = """
run() {
    python3 -m verl.trainer.main_ppo from.function=1
}
for i in 1 2; do python3 -m verl.trainer.main_ppo from.loop=$i; done
python3 -m verl.experimental.fully_async_policy.fully_async_main --config-name=fully_async_ppo_trainer a.b=1
"""
    found = read_script(script, {})
    assert found.module == "verl.experimental.fully_async_policy.fully_async_main"
    assert found.args == ["--config-name=fully_async_ppo_trainer", "a.b=1"]


def test_no_trainer_call_is_an_error():
    with pytest.raises(ShellError, match="no trainer call"):
        read_script("echo hello\npython3 train.py a=1\n", {})
