"""lathe.config.choices: choice keys are Literals that reject other values when set, and the sets that mirror a
table outside config/ (which config may not import) agree with it."""

from typing import get_args

import pytest
import torch

from lathe.config import ConfigError, load_config
from lathe.config import choices


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


@pytest.mark.parametrize(("override", "suggestion", "listed"), [
    ("actor_rollout_ref.rollout.mode=streaming", None, "sync or async"),
    ("actor_rollout_ref.actor.loss_agg_mode=token_mean", "token-mean", "seq-mean-token-sum-norm"),
    ("algorithm.kl_penalty=low-var-kl", "low_var_kl", "k3+"),
    ("actor_rollout_ref.rollout.dtype=bfloat", "bfloat16", "bfloat16, float16 or float32"),
    ("critic.loss_agg_mode=seq-mean", None, "token-mean"),
    ("trainer.use_legacy_worker_impl=yes", None, "auto, enable or disable"),
])
def test_a_value_outside_the_choices_fails_naming_key_value_and_choices(override, suggestion, listed):
    key, value = override.split("=")
    text = refused(override)
    assert f"{key}={value} is not one of the values this key takes." in text
    assert f"Fix: set it to " in text and listed in text
    if suggestion:
        assert f"Did you mean `{suggestion}`?" in text


def test_choices_are_checked_in_yaml_too_and_verl_dtype_numbers_read_as_names(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm:\n  kl_ctrl:\n    type: adaptve\n")
    with pytest.raises(ConfigError, match=r"algorithm.kl_ctrl.type=adaptve .*Did you mean `adaptive`"):
        load_config(str(bad))
    ok = tmp_path / "ok.yaml"
    ok.write_text("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      model_dtype: 32\n")
    assert load_config(str(ok)).actor_rollout_ref.actor.fsdp_config.model_dtype == "32"


def test_optional_choices_take_null_and_lists_check_each_item():
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=null", "global_profiler.tool=null"])
    assert cfg.algorithm.rollout_correction.rollout_is is None
    text = refused("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimiser]")
    assert "save_contents[1]=optimiser" in text and "Did you mean `optimizer`?" in text


def test_the_sets_agree_with_the_tables_they_mirror():
    from lathe.algo.aggregate import LOSS_AGG_MODES
    from lathe.algo.kl import KL_PENALTIES
    from lathe.dtypes import DTYPES
    from lathe.rollout.agent.loop import TRUNCATE_SIDES
    from lathe.rollout.agent.parser import PARSERS
    from lathe.dtypes import rollout_dtype
    from lathe.train.fp8 import RECIPES
    from lathe.algo.pf_ppo import REWEIGHT_METHODS

    assert set(get_args(choices.LossAggMode)) == set(LOSS_AGG_MODES)
    assert set(get_args(choices.Fp8Recipe)) == set(RECIPES)
    assert set(get_args(choices.KLEstimator)) == set(KL_PENALTIES)
    assert set(get_args(choices.DtypeName)) == set(DTYPES)
    assert set(get_args(choices.TruncateSide)) == set(TRUNCATE_SIDES)
    assert set(get_args(choices.ToolCallFormat)) == set(PARSERS)
    assert set(get_args(choices.ReweightMethod)) == set(REWEIGHT_METHODS)
    engine = {name: rollout_dtype(name, torch.device("cuda")) for name in get_args(choices.RolloutDtype)}
    assert len(set(engine.values())) == len(engine), engine          # each name is a dtype of its own
