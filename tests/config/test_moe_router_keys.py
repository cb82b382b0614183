"""Megatron's MoE router training settings (``megatron.override_transformer_config.moe_*``, support_verl): accepted
where lathe's MoE layers compute the same (no load-balancing loss; an expert bias that never updates), refused with
what lathe has instead where they do not (Megatron's per-layer aux loss, the z-loss, bias updates)."""

import warnings

import pytest

from lathe.config import ConfigError, load_config

OTC = "+actor_rollout_ref.actor.megatron.override_transformer_config"
AUX_ON = "+actor_rollout_ref.model.override_config.output_router_logits=true"


def load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config("base", list(overrides))


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(*overrides)
    return str(err.value)


def test_settings_lathe_computes_the_same_load():
    load(f"{OTC}.moe_router_load_balancing_type=none")                  # no load-balancing loss: lathe's default
    load(f"{OTC}.moe_router_enable_expert_bias=true", f"{OTC}.moe_router_bias_update_rate=0")   # a frozen bias
    load(f"{OTC}.moe_aux_loss_coeff=0", f"{OTC}.moe_z_loss_coeff=0.0")


def test_settings_lathe_does_not_have_are_refused_saying_what_it_has():
    text = refused(f"{OTC}.moe_aux_loss_coeff=0.01")
    assert "MoE router training settings" in text and "per sparse layer" in text and "output_router_logits" in text
    assert "no router z-loss" in refused(f"{OTC}.moe_z_loss_coeff=0.001")
    assert "set it to none" in refused(f"{OTC}.moe_router_load_balancing_type=aux_loss")
    assert "set it to none" in refused(f"{OTC}.moe_router_load_balancing_type=none", AUX_ON)   # lathe's loss is on
    assert "moe_router_bias_update_rate=0" in refused(f"{OTC}.moe_router_enable_expert_bias=true")
    assert "aux-loss-free" in refused(f"{OTC}.moe_router_bias_update_rate=0.001")
