"""`gradient_checkpointing_layers` (actor, critic, SFT model): its config rules (`lathe.config.rules_recompute`), the
translation of Megatron's block recompute (`verl_translate.block_recompute`)."""

from __future__ import annotations

import warnings

import pytest
from lathe.config import ConfigError, load_config
from lathe.config.sft import load_sft_config
from lathe.config.support import IgnoredKeysWarning

M, C = "actor_rollout_ref.model", "critic.model"
OTC = "megatron.override_transformer_config"
A_OTC, C_OTC = f"actor_rollout_ref.actor.{OTC}", f"critic.{OTC}"


def load(*overrides: str, record: list | None = None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config("base", list(overrides), device_count=1)
    if record is not None:
        record += [str(w.message) for w in caught if issubclass(w.category, IgnoredKeysWarning)]
    return cfg


def megatron(otc: str, method: str, n: int, granularity: str = "full") -> list[str]:
    return [f"+{otc}.recompute_granularity={granularity}", f"+{otc}.recompute_method={method}",
            f"+{otc}.recompute_num_layers={n}"]


def test_the_count_is_read_per_model_group():
    cfg = load(f"{M}.gradient_checkpointing_layers=3", f"{C}.gradient_checkpointing_layers=0")
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers == 3
    assert cfg.critic.model.gradient_checkpointing_layers == 0
    assert load().actor_rollout_ref.model.gradient_checkpointing_layers is None, "default: every layer"
    sft = load_sft_config(None, ["model.gradient_checkpointing_layers=5"])
    assert sft.model.gradient_checkpointing_layers == 5


@pytest.mark.parametrize("group", [M, C])
def test_a_count_with_checkpointing_off_fails_naming_both_keys(group):
    with pytest.raises(ConfigError) as err:
        load(f"{group}.enable_gradient_checkpointing=false", f"{group}.gradient_checkpointing_layers=2")
    assert f"{group}.gradient_checkpointing_layers=2" in str(err.value)
    assert f"{group}.enable_gradient_checkpointing=false" in str(err.value)


def test_sft_count_with_checkpointing_off_and_bad_values_fail():
    with pytest.raises(ConfigError, match=r"model\.gradient_checkpointing_layers=1 .*model\.enable_gradient_"
                                          r"checkpointing=false"):
        load_sft_config(None, ["model.enable_gradient_checkpointing=false", "model.gradient_checkpointing_layers=1"])
    with pytest.raises(ConfigError, match=r"model\.gradient_checkpointing_layers=-2: give the number"):
        load_sft_config(None, ["model.gradient_checkpointing_layers=-2"])
    with pytest.raises(ConfigError, match=r"model\.impl=hf"):
        load_sft_config(None, ["model.gradient_checkpointing_layers=1", "model.impl=hf"])


def test_negative_and_transformers_counts_are_refused():
    with pytest.raises(ConfigError, match=r"critic\.model\.gradient_checkpointing_layers=-1: give the number"):
        load(f"{C}.gradient_checkpointing_layers=-1")
    with pytest.raises(ConfigError, match=r"only lathe's decoder .* actor_rollout_ref\.model\.impl=hf"):
        load(f"{M}.gradient_checkpointing_layers=2", f"{M}.impl=hf")


def test_megatron_block_recompute_translates_per_role():
    cfg = load(*megatron(A_OTC, "block", 3), *megatron(C_OTC, "block", 0))
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers == 3
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    assert cfg.critic.model.gradient_checkpointing_layers == 0


def test_block_counts_per_pipeline_stage_become_the_same_share_of_one_stack():
    pp = ["+actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
          "+actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"]
    assert load(*megatron(A_OTC, "block", 3), *pp).actor_rollout_ref.model.gradient_checkpointing_layers == 12


@pytest.mark.parametrize("n", [1, 2])
def test_uniform_recompute_stays_whole_layer(n):
    said: list[str] = []
    cfg = load(*megatron(A_OTC, "uniform", n), record=said)
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers is None
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    recompute = [m for m in said if "recompute_" in m]
    if n == 1:
        assert recompute == [], "uniform recompute of one layer at a time is lathe's whole recompute: nothing to say"
    else:
        assert "chunks of 2 layers runs as lathe's recompute of every layer" in recompute[0]


def test_block_without_full_granularity_is_not_read():
    said: list[str] = []
    cfg = load(f"+{A_OTC}.recompute_method=block", f"+{A_OTC}.recompute_num_layers=2", record=said)
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers is None
    assert any("recompute_method`=block has no effect" in m and "recompute_granularity=full" in m for m in said)


def test_lathes_own_count_wins_and_checkpointing_off_drops_the_block_count():
    for order in (1, -1):
        keys = [*megatron(A_OTC, "block", 3), f"{M}.gradient_checkpointing_layers=5"][::order]
        assert load(*keys).actor_rollout_ref.model.gradient_checkpointing_layers == 5
    cfg = load(*megatron(A_OTC, "block", 3), f"{M}.enable_gradient_checkpointing=false")
    assert not cfg.actor_rollout_ref.model.enable_gradient_checkpointing
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers is None


def test_block_recompute_under_transformers_has_no_effect_instead_of_failing():
    """impl=hf trains without recomputation: Megatron's block keys set no count there (a count would be refused,
    naming a key the script never set); they say they have no effect."""
    said: list[str] = []
    cfg = load(*megatron(A_OTC, "block", 2), f"{M}.impl=hf", record=said)
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers is None
    assert any("recompute_num_layers`=2 has no effect" in m and f"{M}.impl=hf" in m for m in said), said


@pytest.mark.parametrize("method", ["block", "uniform"])
def test_megatron_keys_that_lathes_own_count_overrules_say_so(method):
    """lathe's count wins in any order (a saved config.yaml holds the translated one): Megatron keys that would give
    another count (block: N x stages; uniform: every layer) warn that they have no effect, naming lathe's key."""
    said: list[str] = []
    cfg = load(f"{M}.gradient_checkpointing_layers=5", *megatron(A_OTC, method, 3), record=said)
    assert cfg.actor_rollout_ref.model.gradient_checkpointing_layers == 5
    assert any("recompute_num_layers`=3 has no effect" in m and f"{M}.gradient_checkpointing_layers=5" in m
               for m in said), said
    said.clear()
    load(f"{M}.gradient_checkpointing_layers=3", *megatron(A_OTC, "block", 3), record=said)
    assert not [m for m in said if "recompute_" in m], "the same count: nothing to say"
