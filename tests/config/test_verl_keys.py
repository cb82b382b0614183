"""Every key of verl's current schema (``lathe/config/verl_keys.yaml``) is known to lathe, and the backend keys
lathe translates do what ``verl_translate.py`` and docs/config_keys.md say."""

from __future__ import annotations

import warnings

import pytest
import yaml

from lathe.config import ConfigError, LatheConfig, load_config, to_yaml
from lathe.config.coerce import show
from lathe.config.support import IgnoredKeysWarning
from lathe.config.support_verl import entry_for
from lathe.config.errors import ProblemList
from lathe.config.tree import all_paths, assign, get_path, lathe_spelling, parse_override, rewrite_aliases
from lathe.config.verl_keys import generate, verl_defaults
from lathe.config.verl_translate import translate

# Keys another branch makes known (the rollout helper's actor_rollout_ref.rollout.*); delete once merged.
NOT_MINE: tuple[str, ...] = ()
A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
R = "actor_rollout_ref.rollout"
# verl defaults lathe refuses on purpose (or that only hold beside another key), with why
REFUSED_AT_VERLS_DEFAULT = {
    f"{R}.name": "???: verl's mark for a value every run must give",
    f"{R}.tensor_model_parallel_size": "verl's default is 2; tensor-parallel generation is lathe issue 43",
    f"{R}.n_gpus_per_node": "verl copies trainer.n_gpus_per_node here (8 only beside a trainer of 8)",
}


def verl_items() -> list[tuple[str, object]]:
    return [(k, v) for k, v in verl_defaults().items() if not k.startswith(NOT_MINE)]


def load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        return load_config("base", list(overrides), device_count=1)


def lathe_key(key: str) -> bool:
    """A key of lathe's tree, or one below a lathe field that is an open mapping (actor.profiler, ray_kwargs)."""
    key = lathe_spelling(key)
    parts = key.split(".")
    paths = set(all_paths())
    return key in paths or any(".".join(parts[:i]) in paths and isinstance(
        get_path(LatheConfig(), lathe_spelling(".".join(parts[:i]))), dict) for i in range(1, len(parts)))


def test_every_verl_key_is_classified():
    """A lathe key (acts, or in the registry), or a verl key a pattern of support_verl.py judges."""
    unjudged = [k for k, _ in verl_items() if not lathe_key(k) and entry_for(k) is None]
    assert not unjudged, "verl keys no pattern of lathe/config/support_verl.py matches:\n  " + "\n  ".join(unjudged)


def test_every_verl_key_loads_at_verls_default():
    """Each key, set alone to verl's default, loads (nothing refused); one load per key would take minutes, so
    they load in groups, and a failing group is retried key by key to name the culprit."""
    skip = {"trainer.default_local_dir", *REFUSED_AT_VERLS_DEFAULT}       # an interpolation; refused on purpose
    items = [(k, v) for k, v in verl_items() if k not in skip]
    failures = []
    for start in range(0, len(items), 100):
        chunk = items[start:start + 100]
        try:
            load(*(f"{k}={show(v)}" for k, v in chunk))
        except ConfigError:
            for k, v in chunk:
                try:
                    load(f"{k}={show(v)}")
                except ConfigError as err:
                    failures.append(f"{k}={show(v)}: {str(err).splitlines()[-1][:200]}")
    assert not failures, "verl keys that fail at verl's default:\n  " + "\n  ".join(failures)


def test_the_key_list_is_generated_from_verls_files(tmp_path):
    """The generator flattens, resolves oc.select (nested too) and relative references, and drops _target_."""
    path = tmp_path / "v.yaml"
    path.write_text("a:\n  _target_: x.Y\n  b: 1\n  c: ${oc.select:a.missing,${.b}}\n  d: {}\n"
                    "e:\n  f: ${oc.select:a.b,7}\n")
    text = generate([str(path)])
    assert "a.b: 1\na.c: 1\na.d: {}\ne.f: 1\n" in text and "_target_" not in text


def test_a_typo_in_a_verl_key_is_still_unknown():
    with pytest.raises(ConfigError, match=r"Unknown config key .*tensor_model_paralel_size.*Did you mean "
                                          r"`actor_rollout_ref\.actor\.megatron\.tensor_model_parallel_size`"):
        load(f"{A}.megatron.tensor_model_paralel_size=2")
    with pytest.raises(ConfigError, match="Unknown config key `actor_rollout_ref.actor.megatorn.param_offload`"):
        load(f"{A}.megatorn.param_offload=true")


def test_hydra_target_keys_and_prefixes_are_accepted():
    cfg = load(f"+{A}.megatron._target_=verl.workers.config.McoreEngineConfig",
               f"++{A}.megatron.param_offload=true", f"+{A}.megatron.override_transformer_config.apply_rope_fusion=true")
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert f"{A}.megatron._target_" not in cfg.verl_keys


@pytest.mark.parametrize("override, key, value", [
    (f"{A}.megatron.param_offload=true", f"{A}.fsdp_config.param_offload", True),
    (f"{A}.megatron.optimizer_offload=true", f"{A}.fsdp_config.optimizer_offload", True),
    ("actor_rollout_ref.ref.megatron.param_offload=true", "actor_rollout_ref.ref.fsdp_config.param_offload", True),
    ("critic.megatron.optimizer_offload=true", "critic.model.fsdp_config.optimizer_offload", True),
    (f"{A}.veomni.param_offload=true", f"{A}.fsdp_config.param_offload", True),
    (f"{A}.torchtitan.optimizer_offload=true", f"{A}.fsdp_config.optimizer_offload", True),
    (f"{A}.megatron.dtype=float16", f"{A}.fsdp_config.mixed_precision.param_dtype", "fp16"),
    (f"{A}.torchtitan.dtype=float32", f"{A}.fsdp_config.mixed_precision.param_dtype", "fp32"),
    (f"{A}.veomni.mixed_precision=false", f"{A}.fsdp_config.mixed_precision.param_dtype", "fp32"),
    (f"{A}.veomni.fsdp_size=2", f"{A}.fsdp_config.fsdp_size", 2),
    ("actor_rollout_ref.ref.torchtitan.data_parallel_shard_size=4", "actor_rollout_ref.ref.fsdp_config.fsdp_size", 4),
    (f"{A}.fsdp_config.dtype=float32", f"{A}.fsdp_config.mixed_precision.param_dtype", "fp32"),
    ("critic.fsdp.dtype=float32", "critic.model.fsdp_config.mixed_precision.param_dtype", "fp32"),
    ("critic.fsdp.param_offload=true", "critic.model.fsdp_config.param_offload", True),
    (f"{A}.fsdp_config.ulysses_sequence_parallel_size=1", f"{A}.ulysses_sequence_parallel_size", 1),
    (f"{A}.optim.lr_decay_style=cosine", f"{A}.optim.lr_scheduler_type", "cosine"),
    (f"{M}.lora.rank=8", f"{M}.lora_rank", 8),
    (f"{M}.lora.alpha=64", f"{M}.lora_alpha", 64),
    ("reward.reward_manager.name=dapo", "reward_model.reward_manager", "dapo"),
    ("reward.sandbox_fusion.url=http://sandbox", "reward_model.sandbox_fusion.url", "http://sandbox"),
    (f"{A}.policy_loss.tau_pos=2.0", f"{A}.tau_pos", 2.0),
])
def test_translated_keys_set_lathes_key(override, key, value):
    assert get_path(load(override), key) == value


def test_sequence_parallel_spellings_set_the_roles_size():
    """verl's spellings of a role's Ulysses size, Megatron's and torchtitan's context parallelism included (the
    reference's null takes the actor's)."""
    two = ["trainer.n_gpus_per_node=2", f"{M}.use_remove_padding=true"]
    for spelling in (f"{A}.ulysses_sequence_parallel_size", f"{A}.fsdp_config.ulysses_sequence_parallel_size",
                     f"{A}.veomni.ulysses_parallel_size", f"{A}.megatron.context_parallel_size",
                     f"{A}.torchtitan.context_parallel_size",
                     f"{A}.megatron.override_transformer_config.context_parallel_size"):
        cfg = load_config("base", [*two, f"{spelling}=2"])
        assert (cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
                cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size) == (2, 2), spelling
    assert translate("actor_rollout_ref.ref.veomni.ulysses_parallel_size", 2) == [
        ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", 2)]
    assert translate(f"{A}.veomni.ulysses_parallel_size", 1) == []


def test_offload_policy_translation():
    """veomni's FSDP offload is FSDP2's offload policy (refused on one device, so checked on the mapping)."""
    assert translate(f"{A}.veomni.enable_fsdp_offload", True) == [(f"{A}.fsdp_config.offload_policy", True)]
    assert translate(f"{A}.veomni.enable_fsdp_offload", False) == []


def test_recompute_switches_gradient_checkpointing():
    off = [f"{M}.enable_gradient_checkpointing=false", "critic.model.enable_gradient_checkpointing=false"]
    otc = "megatron.override_transformer_config"
    for granularity in ("full", "selective"):
        cfg = load(*off, f"+{A}.{otc}.recompute_granularity={granularity}",
                   f"+critic.{otc}.recompute_granularity={granularity}")
        assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
        assert cfg.critic.model.enable_gradient_checkpointing is True
    assert load(*off, f"+{A}.{otc}.recompute_granularity=null").actor_rollout_ref.model.enable_gradient_checkpointing \
        is False, "verl's default (no recomputation named) leaves lathe's switch as it is"
    assert load(f"{A}.torchtitan.activation_checkpoint=none").actor_rollout_ref.model.enable_gradient_checkpointing \
        is False


def test_a_later_lathe_key_wins_over_a_translated_one():
    cfg = load(f"{A}.megatron.param_offload=true", f"{A}.fsdp_config.param_offload=false")
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is False


def test_verl_defaults_leave_lathe_keys_alone():
    cfg = load(f"{A}.fsdp_config.param_offload=true", f"{A}.megatron.param_offload=false",
               f"{A}.fsdp_config.mixed_precision.param_dtype=fp32", f"{A}.megatron.dtype=bfloat16")
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload is True
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"


@pytest.mark.parametrize("override, feature", [
    (f"{A}.megatron.expert_tensor_parallel_size=2", "expert tensor parallelism (lathe issue 43"),
    (f"{A}.torchtitan.data_parallel_replicate_size=2", "torchtitan's replica count"),
    ("critic.model.mtp.enable=true", "multi-token prediction (MTP; lathe issue 44"),
    ("actor_rollout_ref.ref.router_replay.mode=R3", "MoE routing replay (R2/R3, lathe issue 44"),
    (f"{A}.fsdp_config.qat.enable=true", "quantization-aware training (QAT; lathe issue 48"),
    (f"+{A}.megatron.override_transformer_config.fp8=e4m3", "FP8 training (lathe issue 48"),
])
def test_features_lathe_lacks_are_refused_by_name(override, feature):
    with pytest.raises(ConfigError) as err:
        load(override)
    key = lathe_spelling(override.lstrip("+").split("=")[0])
    assert feature in str(err.value) and key in str(err.value)


def test_kernel_switches_and_backends_warn_once():
    with pytest.warns(IgnoredKeysWarning) as caught:
        load_config("base", ["model_engine=megatron", f"{A}.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                             f"{A}.megatron.use_mbridge=false",
                             f"+{A}.megatron.override_transformer_config.apply_rope_fusion=true"], device_count=1)
    text = "\n".join(str(w.message) for w in caught if w.category is IgnoredKeysWarning)
    assert text.count("runs on lathe's FSDP2 trainer") == 1
    assert "use_mbridge" in text and "apply_rope_fusion" in text
    with pytest.warns(IgnoredKeysWarning) as caught:        # verl's examples README's spelling of model_engine
        load_config("base", [f"{A}.model_engine=megatron", f"{A}.strategy=megatron"], device_count=1)
    text = "\n".join(str(w.message) for w in caught if w.category is IgnoredKeysWarning)
    assert text.count("runs on lathe's FSDP2 trainer") == 1 and f"`{A}.model_engine`=megatron" in text


def test_verl_keys_round_trip(tmp_path):
    cfg = load(f"{A}.megatron.param_offload=true", f"{A}.megatron.use_mbridge=false")
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        again = load_config(str(path), device_count=1)
    assert again.verl_keys == cfg.verl_keys and again.actor_rollout_ref.actor.fsdp_config.param_offload


def test_a_verl_group_given_as_a_mapping_is_taken_key_by_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("preset: base\nactor_rollout_ref:\n  actor:\n    megatron:\n      _target_: x.Y\n"
                    "      param_offload: true\n      override_transformer_config:\n        recompute_granularity: full\n"
                    "critic:\n  fsdp:\n    _target_: x.Z\n    optimizer_offload: true\n    seed: 42\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredKeysWarning)
        cfg = load_config(str(path), device_count=1)
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_offload and cfg.critic.model.fsdp_config.optimizer_offload
    assert cfg.verl_keys["critic.fsdp.seed"] == 42


def test_lathes_own_keys_never_land_in_verl_keys():
    """A verl key lathe has a field for (or an alias of one) is set on that field, never held aside."""
    cfg = LatheConfig()
    for key, value in verl_items():
        if lathe_key(key):
            try:
                assign(cfg, rewrite_aliases([parse_override(f"{key}={show(value)}")], ProblemList())[0])
            except ConfigError:
                pass                                   # verl's null for a lathe key that takes none: tested above
    assert not cfg.verl_keys


def verl_file(tmp_path, **changes) -> str:
    """verl's whole schema at verl's defaults as one nested YAML file (what a verl user's full config looks like)."""
    tree: dict = {}
    for key, value in [*verl_items(), *changes.items()]:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    tree["trainer"]["n_gpus_per_node"] = 1
    rollout = tree["actor_rollout_ref"]["rollout"]
    rollout.update(name="vllm", tensor_model_parallel_size=1, n_gpus_per_node=1)   # see REFUSED_AT_VERLS_DEFAULT
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


# Rollout keys that warn at verl's defaults (the rollout branch's verdicts; quiet them there, then drop them here)
WARN_AT_VERLS_DEFAULT = (f"{R}.update_weights_bucket_megabytes", f"{R}.trace")


def notices(caught) -> list[str]:
    """The lines of the run's IgnoredKeysWarning, less those of WARN_AT_VERLS_DEFAULT."""
    lines = [line for w in caught if w.category is IgnoredKeysWarning for line in str(w.message).splitlines()[1:]]
    return [line for line in lines if not any(f"`{k}`=" in line for k in WARN_AT_VERLS_DEFAULT)]


def test_verls_whole_schema_loads_as_a_file_without_a_warning(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(verl_file(tmp_path), device_count=1)
    assert notices(caught) == []


def test_verls_megatron_defaults_load_with_one_notice(tmp_path):
    megatron = {f"{g}.strategy": "megatron" for g in (A, "actor_rollout_ref.ref", "critic")}
    megatron |= {f"{g}.optim.optimizer": "adam" for g in (A, "critic")}      # megatron's name for AdamW
    with pytest.warns(IgnoredKeysWarning) as caught:
        load_config(verl_file(tmp_path, **megatron), device_count=1)
    (notice,) = notices(caught)
    assert "megatron runs on lathe's FSDP2 trainer" in notice


def test_explain_gives_verl_keys_their_verdicts():
    from lathe.config.explain import NO_EFFECT, REFUSED, RENAMED, SAME, UNKNOWN, explain
    rows = {r.key: r for r in explain([f"{A}.megatron.param_offload=true", f"{A}.megatron.expert_tensor_parallel_size=2",
                                       f"{A}.megatron.tensor_model_parallel_size=2",
                                       f"+{A}.megatron.override_transformer_config.apply_rope_fusion=true",
                                       f"{A}.megatron.use_mbridge=true", f"{A}.megatron.tensor_model_paralel_size=1"]).rows}
    assert rows[f"{A}.megatron.param_offload"].verdict == RENAMED
    assert f"{A}.fsdp_config.param_offload" in rows[f"{A}.megatron.param_offload"].why
    assert rows[f"{A}.megatron.expert_tensor_parallel_size"].verdict == REFUSED
    assert rows[f"{A}.megatron.tensor_model_parallel_size"].verdict == RENAMED
    assert f"{A}.fsdp_config.tensor_parallel_size" in rows[f"{A}.megatron.tensor_model_parallel_size"].why
    assert rows[f"{A}.megatron.override_transformer_config.apply_rope_fusion"].verdict == NO_EFFECT
    assert rows[f"{A}.megatron.use_mbridge"].verdict == SAME                  # verl's default
    assert rows[f"{A}.megatron.tensor_model_paralel_size"].verdict == UNKNOWN


def test_help_names_what_lathe_does_with_a_verl_key():
    from lathe.config import help_for
    assert "fsdp_config.param_offload" in help_for(f"{A}.megatron.param_offload")
    assert "FSDP sharding over those devices" in help_for(f"{A}.megatron.pipeline_model_parallel_size")
    assert "fsdp_config.tensor_parallel_size" in help_for(f"{A}.megatron.tensor_model_parallel_size")
    assert help_for(f"{A}.megatron.no_such_key") == ""
