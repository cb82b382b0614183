"""verl's newer SFT trainer (`verl.trainer.sft_trainer`) in `lathe sft` (`lathe.config.sft_engine`): its example
scripts (``verl_sft_scripts/*.txt``, one override per line) load, or stop only on features lathe sft names; its
config-group selections bring that trainer's defaults; the fsdp engine's keys act as lathe sft's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lathe.config import ConfigError
from lathe.config.sft import load_sft_config

SCRIPTS = Path(__file__).parent / "verl_sft_scripts"
# what stops a script that does not load: each a feature lathe sft names
NAMED = ("verl's SFT trainer with that config group is not implemented yet in lathe sft",
         "verl's SFT trainer with those config groups is not implemented yet in lathe sft",
         "Ulysses sequence parallelism in lathe sft")
LOADS = {"e2e_run_sft", "gsm8k_deepseek_coder_6_7b_fsdp", "gsm8k_gemma_2b_fsdp", "gsm8k_gemma_7b_fsdp",
         "gsm8k_qwen2_5_0_5b_fsdp", "multiturn_qwen2_5_0_5b_fsdp"}


def load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_sft_config(None, list(overrides))


@pytest.mark.parametrize("script", sorted(p.stem for p in SCRIPTS.glob("*.txt")))
def test_verls_sft_script_loads_or_stops_on_named_features(script):
    overrides = (SCRIPTS / f"{script}.txt").read_text().split()
    try:
        load(*overrides)
    except ConfigError as err:
        assert script not in LOADS, str(err)
        lines = [line for line in str(err).splitlines() if line.strip() and "config problems" not in line]
        assert all(any(n in line for n in NAMED) for line in lines), str(err)
    else:
        assert script in LOADS, f"{script} loads: add it to LOADS"


def test_the_corpus_is_there():
    assert len(list(SCRIPTS.glob("*.txt"))) == 16 and LOADS <= {p.stem for p in SCRIPTS.glob("*.txt")}


def test_a_group_selection_brings_the_newer_trainers_defaults_and_the_scripts_keys_win():
    old = load()
    assert (old.data.train_batch_size, old.data.use_dynamic_bsz, old.optim.lr, old.optim.lr_scheduler_type,
            old.optim.lr_warmup_steps_ratio, old.optim.betas) == (64, False, 1e-5, "cosine", 0.1, [0.9, 0.95])
    new = load("engine=fsdp", "optim.lr=1e-4")
    assert (new.data.train_batch_size, new.data.use_dynamic_bsz, new.data.val_files, new.optim.lr,
            new.optim.lr_scheduler_type, new.optim.lr_warmup_steps_ratio, new.optim.betas) == \
        (256, True, None, 1e-4, "constant", 0.0, [0.9, 0.999])
    assert load("model=hf_model", "data.train_batch_size=32").data.train_batch_size == 32
    mega = load("optim=megatron", "optim.lr_decay_style=cosine", "optim.min_lr=1e-6", "optim.lr=1e-5")
    assert (mega.optim.lr_scheduler_type, mega.optim.min_lr, mega.optim.lr, mega.optim.betas) == \
        ("cosine", 1e-6, 1e-5, [0.9, 0.999])
    assert load("optim=megatron").optim.lr_scheduler_type == "constant"       # optim/megatron.yaml's
    assert load("optim=megatron", "optim.optimizer=adam").optim.optimizer == "AdamW"   # Megatron's adam: decoupled
    assert load("optim.optimizer=Adam").optim.optimizer == "Adam"                       # torch's, elsewhere


def test_the_fsdp_engines_keys_act_as_lathe_sfts():
    cfg = load("engine=fsdp", "engine.strategy=fsdp2", "engine.fsdp_size=2", "engine.param_offload=true",
               "engine.dtype=float32", "engine.model_dtype=bf16", "engine.ulysses_sequence_parallel_size=1",
               "engine.entropy_from_logits_with_chunking=true", "engine.seed=42", "engine.qat.mode=w4a16",
               "trainer.n_gpus_per_node=4")
    f = cfg.model.fsdp_config
    assert (f.strategy, f.fsdp_size, f.param_offload, f.mixed_precision.param_dtype, f.model_dtype) == \
        ("fsdp2", 2, True, "float32", "bf16")
    with pytest.warns(UserWarning, match=r"`engine.seed`=7 has no effect in lathe sft: lathe sft seeds"):
        load_sft_config(None, ["engine=fsdp", "engine.seed=7"])
    with pytest.raises(ConfigError) as err:              # as unknown keys, before the checks of what loaded
        load("engine=fsdp", "engine.qat.enable=true", "engine.fsdp_sise=2", "data.train_batch_sise=8")
    text = str(err.value)
    assert "`engine.qat.enable`=true: quantization-aware training" in text
    assert "Unknown config key `engine.fsdp_sise`" in text and "fsdp_size" in text
    assert "Unknown config key `data.train_batch_sise`" in text
    with pytest.raises(ConfigError, match="Ulysses sequence parallelism in lathe sft"):
        load("engine=fsdp", "engine.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2")


@pytest.mark.parametrize("choice", ["engine=megatron", "optim=automodel", "engine=veomni", "model=other"])
def test_a_group_lathe_sft_cannot_run_is_refused_by_name(choice):
    with pytest.raises(ConfigError, match=f"{choice}: verl's SFT trainer with that config group is not implemented"):
        load(choice)
