"""Megatron's MoE router training settings (``megatron.override_transformer_config.moe_*``, support_verl): the
actor's switch loss and z-loss coefficients translate to its own keys; accepted where lathe's MoE layers compute the
same (no load-balancing loss; an expert bias that never updates); refused with what lathe has instead where they do
not (the reference's losses, other balancing types, bias updates). Megatron's context parallelism over padded
micro-batches runs as Ulysses over the packed stream, with one notice."""

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
    cfg = load(f"{OTC}.moe_aux_loss_coeff=0", f"{OTC}.moe_z_loss_coeff=0.0")
    assert cfg.actor_rollout_ref.actor.moe_aux_loss_coeff == cfg.actor_rollout_ref.actor.moe_z_loss_coeff == 0


def test_the_actors_router_losses_translate():
    cfg = load(f"{OTC}.moe_aux_loss_coeff=0.01", f"{OTC}.moe_z_loss_coeff=0.001",
               f"{OTC}.moe_router_load_balancing_type=aux_loss")
    assert (cfg.actor_rollout_ref.actor.moe_aux_loss_coeff, cfg.actor_rollout_ref.actor.moe_z_loss_coeff) == \
        (0.01, 0.001)


def test_settings_lathe_does_not_have_are_refused_saying_what_it_has():
    ref = "+actor_rollout_ref.ref.megatron.override_transformer_config"
    assert "only the actor's router losses" in refused(f"{ref}.moe_aux_loss_coeff=0.01")
    assert "seq_aux_loss" in refused(f"{OTC}.moe_router_load_balancing_type=seq_aux_loss")
    assert "set it to aux_loss" in refused(f"{OTC}.moe_router_load_balancing_type=none", AUX_ON)   # a loss is on
    assert "set it to aux_loss" in refused(f"{OTC}.moe_router_load_balancing_type=none",
                                           f"{OTC}.moe_aux_loss_coeff=0.01")
    assert "moe_router_bias_update_rate=0" in refused(f"{OTC}.moe_router_enable_expert_bias=true")
    assert "aux-loss-free" in refused(f"{OTC}.moe_router_bias_update_rate=0.001")


def test_context_parallelism_over_padded_micro_batches_runs_packed_with_a_notice():
    cp = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=false",
          "+actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = load_config("base", cp, device_count=2)
    arr = cfg.actor_rollout_ref
    assert arr.model.use_remove_padding and arr.actor.ulysses_sequence_parallel_size == 2
    assert any("context-parallel size (actor_rollout_ref.actor: CP 2)" in str(w.message) for w in seen)
    # lathe's own Ulysses key over padded micro-batches stays refused: nothing translated it
    assert "runs it padded" in refused("trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=false",
                                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
