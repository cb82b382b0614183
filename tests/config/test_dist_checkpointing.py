"""verl's megatron.use_dist_checkpointing / dist_checkpointing_path: the actor's act (the policy starts from that
Megatron checkpoint, `lathe.models.megatron_ckpt`), the reference's must agree with them, the critic's stay refused, a
path without the switch has no effect (as in verl), and a missing directory fails at start-up naming the key."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lathe.config.support import IgnoredKeysWarning
from lathe.config.verl_translate import dist_checkpoint
from lathe.loop.preflight import preflight

from .test_rules_tp import fails, load

A, REF = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron"
SCRIPTS = Path(__file__).resolve().parent / "verl_scripts"


def _quiet_load(*overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load(*overrides)
    return cfg, "\n".join(str(w.message) for w in caught if issubclass(w.category, IgnoredKeysWarning))


def test_the_actors_keys_name_the_checkpoint_the_policy_starts_from(tmp_path):
    cfg, ignored = _quiet_load(f"{A}.use_dist_checkpointing=true", f"{A}.dist_checkpointing_path={tmp_path}",
                               f"{REF}.use_dist_checkpointing=true", f"{REF}.dist_checkpointing_path={tmp_path}/")
    assert dist_checkpoint(cfg) == str(tmp_path)
    assert "dist_checkpointing" not in ignored


def test_a_path_without_the_switch_has_no_effect_as_in_verl(tmp_path):
    cfg, ignored = _quiet_load(f"{A}.dist_checkpointing_path={tmp_path}", f"{REF}.dist_checkpointing_path={tmp_path}")
    assert dist_checkpoint(cfg) is None
    for role in (A, REF):
        assert f"`{role}.dist_checkpointing_path`" in ignored
    assert "read only with actor_rollout_ref.actor.megatron.use_dist_checkpointing=true" in ignored


@pytest.mark.parametrize("ref", [[], [f"{REF}.use_dist_checkpointing=true", f"{REF}.dist_checkpointing_path=/other"]])
def test_a_reference_starting_from_other_weights_than_the_actor_is_refused(tmp_path, ref):
    load(f"{A}.use_dist_checkpointing=true", f"{A}.dist_checkpointing_path={tmp_path}", *ref)   # no reference: fine
    kl = "actor_rollout_ref.actor.use_kl_loss=true"
    err = fails(f"{A}.use_dist_checkpointing=true", f"{A}.dist_checkpointing_path={tmp_path}", kl, *ref)
    assert f"{REF if ref else A}.use_dist_checkpointing" in err and "other weights than the actor" in err
    assert "lathe's reference copies the actor's starting weights" in err


def test_the_critics_checkpoint_stays_refused(tmp_path):
    err = fails("critic.megatron.use_dist_checkpointing=true", f"critic.megatron.dist_checkpointing_path={tmp_path}",
                "algorithm.adv_estimator=gae")
    assert "loading a Megatron distributed checkpoint into the critic" in err


def test_a_missing_directory_fails_at_start_up_naming_the_key(tmp_path):
    for path, what in (("", "is empty"), (str(tmp_path / "nope"), "no such directory"),
                       (str(tmp_path), "has no metadata.json")):
        cfg = load(f"{A}.use_dist_checkpointing=true", f"{A}.dist_checkpointing_path={path}",
                   f"{REF}.use_dist_checkpointing=true", f"{REF}.dist_checkpointing_path={path}")
        with pytest.raises(ValueError) as err:
            preflight(cfg)
        assert f"{A}.dist_checkpointing_path" in str(err.value) and what in str(err.value)


def test_the_moonlight_script_loads(capsys):
    from lathe.cli import main
    lines = (SCRIPTS / "grpo_trainer_run_moonlight_16b_a3b_megatron.txt").read_text().splitlines()
    args = [line.strip() for line in lines if line.strip() and not line.startswith("--")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--print-config", *args]) == 0
    assert "use_dist_checkpointing: true" in capsys.readouterr().out
