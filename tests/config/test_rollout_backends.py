"""verl's inference-backend keys (rollout.name=vllm|sglang|trtllm, engine_kwargs, the engine knobs) on lathe's engine.

The corpus test replays verl's example launch scripts (tests/config/verl_scripts): a rollout key may fail a script
only by asking for a feature lathe lacks, named with its issue.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from lathe.config import ConfigError, load_config, run_plan
from lathe.config.coerce import hints_of
from lathe.config.schema import LatheConfig
from lathe.config.support import IgnoredKeysWarning
from lathe.config.tree import ALIASES, _is_dict_type, dataclass_type

R = "actor_rollout_ref.rollout"
SCRIPTS = Path(__file__).parent / "verl_scripts"

# verl's actor_rollout_ref.rollout keys (verl 1dda039b9, its generated ppo / ppo_megatron / ppo_torchtitan /
# ppo_veomni trainer configs), group -> leaves
VERL_ROLLOUT_KEYS = {
    "": "calculate_log_probs cudagraph_capture_sizes data_parallel_size disable_log_stats do_sample dtype "
        "enable_chunked_prefill enable_prefix_caching enable_rollout_routing_replay enforce_eager "
        "expert_parallel_size free_cache_engine full_determinism gpu_memory_utilization ignore_eos layered_summon "
        "load_format log_prob_max_token_len_per_gpu log_prob_micro_batch_size log_prob_micro_batch_size_per_gpu "
        "log_prob_use_dynamic_bsz logprobs_mode max_model_len max_num_batched_tokens max_num_seqs mode "
        "moe_load_balance_metrics_interval mtp multi_stage_wake_up n n_gpus_per_node name nnodes over_sample_rate "
        "pipeline_model_parallel_size prompt_length qat quantization quantization_config_file response_length "
        "scheduling_policy seed skip_tokenizer_init temperature tensor_model_parallel_size top_k top_p",
    "agent": "agent_loop_config_path default_agent_loop num_workers",
    "agent.custom_async_server": "name path",
    "checkpoint_engine": "backend custom_backend_module engine_kwargs update_weights_bucket_megabytes",
    "disaggregation": "bootstrap_port decode_replicas decode_tensor_model_parallel_size enabled ib_device "
                      "prefill_replicas transfer_backend",
    "engine_kwargs": "sglang trtllm vllm",
    "multi_turn": "enable format function_tool_path max_assistant_turns max_parallel_calls max_tool_response_length "
                  "max_user_turns num_repeat_rollouts tokenization_sanity_check_mode tool_config_path "
                  "tool_response_truncate_side use_inference_chat_template",
    "profiler": "all_ranks enable finish_hook_all_ranks finish_hook_cmd finish_hook_ranks ranks relocate_results "
                "save_path tool",
    "profiler.tool_config.npu": "analysis contents discrete level profile_token_end profile_token_start",
    "profiler.tool_config.precision_debugger": "config_path stages steps strict",
    "profiler.tool_config.torch": "contents discrete profile_token_end profile_token_start",
    "prometheus": "enable file port served_model_name",
    "trace": "backend experiment_name max_samples_per_step_per_worker project_name token2text",
    "val_kwargs": "do_sample n temperature top_k top_p",
}


def accepted(path: str) -> bool:
    """A key load_config takes: a field of the schema, inside a free-form dict field, or an alias."""
    if path in ALIASES:
        return True
    cls = LatheConfig
    parts = path.split(".")
    for i, part in enumerate(parts):
        hints = hints_of(cls)
        if part not in hints:
            return False
        sub = dataclass_type(hints[part])
        if sub is None:
            return i == len(parts) - 1 or _is_dict_type(hints[part])
        cls = sub
    return True


def load(*overrides: str, **kw):
    return load_config("base", list(overrides), **kw)


def test_every_verl_rollout_key_is_accepted():
    keys = [f"{R}.{group + '.' if group else ''}{leaf}" for group, leaves in VERL_ROLLOUT_KEYS.items()
            for leaf in leaves.split()]
    assert len(keys) == 115
    assert [k for k in keys if not accepted(k)] == []


@pytest.mark.parametrize("name", ["vllm", "sglang", "trtllm"])
def test_verl_backends_load_without_warnings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(f"{R}.name={name}").actor_rollout_ref.rollout.name == name


@pytest.mark.parametrize(("entry", "key", "value"), [
    ("vllm.max_num_seqs=64", "max_num_seqs", 64),
    ("vllm.max_num_batched_tokens=4096", "max_num_batched_tokens", 4096),
    ("vllm.gpu_memory_utilization=0.7", "gpu_memory_utilization", 0.7),
    ("vllm.max_model_len=4096", "max_model_len", 4096),
    ("vllm.enforce_eager=true", "enforce_eager", True),
    ("vllm.compilation_config.cudagraph_mode=NONE", "enforce_eager", True),
    ("vllm.compilation_config.cudagraph_capture_sizes=[4,8,16]", "cudagraph_capture_sizes", [4, 8, 16]),
    ("sglang.mem_fraction_static=0.6", "gpu_memory_utilization", 0.6),
    ("sglang.max_running_requests=32", "max_num_seqs", 32),
    ("sglang.chunked_prefill_size=2048", "max_num_batched_tokens", 2048),
    ("sglang.chunked_prefill_size=-1", "enable_chunked_prefill", False),
    ("sglang.disable_radix_cache=true", "enable_prefix_caching", False),
    ("sglang.disable_cuda_graph=true", "enforce_eager", True),
    ("trtllm.max_batch_size=16", "max_num_seqs", 16),
    ("trtllm.max_num_tokens=1024", "max_num_batched_tokens", 1024),
])
def test_engine_kwargs_of_the_named_backend_set_the_engine_keys(entry, key, value):
    backend = entry.split(".")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(f"{R}.name={backend}", f"+{R}.engine_kwargs.{entry}")
    assert getattr(cfg.actor_rollout_ref.rollout, key) == value


def test_engine_kwargs_that_lathe_does_not_have_warn_once_naming_each():
    with pytest.warns(IgnoredKeysWarning) as record:
        cfg = load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.async_scheduling=true",
                   f"+{R}.engine_kwargs.vllm.max_num_seqs=64", f"+{R}.engine_kwargs.vllm.mm_processor_cache_gb=0",
                   f"+{R}.engine_kwargs.vllm.compilation_config.cudagraph_mode=FULL_DECODE_ONLY",
                   f"+{R}.engine_kwargs.sglang.max_running_requests=8")
    text = "\n".join(str(w.message) for w in record if w.category is IgnoredKeysWarning)
    assert len([w for w in record if w.category is IgnoredKeysWarning]) == 1
    assert "vllm.async_scheduling=true" in text and "sglang.max_running_requests=8 (read only with " \
                                                      "rollout.name=sglang)" in text
    assert "max_num_seqs=64" not in text and "mm_processor_cache_gb" not in text and "cudagraph_mode" not in text
    assert cfg.actor_rollout_ref.rollout.max_num_seqs == 64       # only the named backend's entries act
    assert cfg.actor_rollout_ref.rollout.enforce_eager is False


def test_engine_kwargs_asking_for_a_missing_feature_are_refused_naming_it():
    with pytest.raises(ConfigError, match=r"vllm.kv_cache_dtype=fp8_e5m2 \(a KV cache dtype other than auto, fp8, "
                                          r"fp8_e4m3 .*issue 48\)"):
        load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.kv_cache_dtype=fp8_e5m2")
    with pytest.raises(ConfigError, match=r"sglang.kv_cache_dtype=fp8_e5m2 \(a KV cache dtype other than"):
        load(f"{R}.name=sglang", f"+{R}.engine_kwargs.sglang.kv_cache_dtype=fp8_e5m2")
    with pytest.raises(ConfigError, match=r"quantization=int8 \(quantized rollout .*issue 48\)"):
        load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.quantization=int8")
    assert load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.kv_cache_dtype=auto").actor_rollout_ref.rollout.\
        kv_cache_dtype == "auto"


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3"])
def test_engine_kwargs_fp8_kv_cache_acts(backend, dtype):
    """verl's `engine_kwargs.<backend>.kv_cache_dtype=fp8` (DeepSeek-V4's scripts) sets lathe's FP8 KV cache."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(f"{R}.name={backend}", f"+{R}.engine_kwargs.{backend}.kv_cache_dtype={dtype}")
    assert cfg.actor_rollout_ref.rollout.kv_cache_dtype == dtype


def test_kv_cache_dtype_key_refuses_other_dtypes_and_the_transformers_rollout():
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*fp8_e5m2.*auto.*fp8.*fp8_e4m3"):
        load(f"{R}.kv_cache_dtype=fp8_e5m2")
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=fp8 is lathe's engine's FP8 KV cache, but the rollout "
                                          r"runs transformers generate"):
        load(f"{R}.name=hf", f"{R}.kv_cache_dtype=fp8")
    assert load(f"{R}.kv_cache_dtype=fp8_e4m3").actor_rollout_ref.rollout.kv_cache_dtype == "fp8_e4m3"


def test_engine_kwargs_and_the_rollout_key_set_differently_fail():
    with pytest.raises(ConfigError, match=r"engine_kwargs.vllm.max_num_seqs`=64 and `actor_rollout_ref.rollout."
                                          r"max_num_seqs`=32 are both set"):
        load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.max_num_seqs=64", f"{R}.max_num_seqs=32")
    cfg = load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.max_num_seqs=64", f"{R}.max_num_seqs=64")
    assert cfg.actor_rollout_ref.rollout.max_num_seqs == 64
    with pytest.raises(ConfigError, match=r"max_num_seqs"):
        load(f"{R}.name=vllm", f"+{R}.engine_kwargs.vllm.max_num_seqs=many")


def test_checkpoint_engine_bucket_size_is_the_same_setting():
    with pytest.warns(IgnoredKeysWarning, match="update_weights_bucket_megabytes`=1024 has no effect"):   # colocated
        cfg = load(f"{R}.checkpoint_engine.update_weights_bucket_megabytes=1024")
    assert cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 1024
    with pytest.raises(ConfigError, match="same setting"):
        load(f"{R}.checkpoint_engine.update_weights_bucket_megabytes=1024", f"{R}.update_weights_bucket_megabytes=64")


@pytest.mark.parametrize(("override", "feature"), [
    ("pipeline_model_parallel_size=2", "issue 43"),
    ("expert_parallel_size=8", "issue 43"), ("data_parallel_size=2", "issue 43"),
    ("moe_tensor_parallel_size=2", "issue 43"),
    ("quantization=int8", "issue 48"), ("qat={enable: true}", "issue 48"),
    ("disaggregation.enabled=true", "prefill-decode disaggregation"),
    ("logprobs_mode=raw_logits", "raw log-probs or logits"),
    ("nnodes=1", "top-level rollout.nnodes"),
    ("agent.custom_async_server.path=server.py", "custom_async_server"),
])
def test_features_lathe_lacks_are_refused_naming_them(override, feature):
    with pytest.raises(ConfigError, match=re.escape(feature)):
        load(f"{R}.{override}")


def test_expert_parallel_size_is_the_size_of_a_tensor_parallel_replica():
    """verl's EP = TP x data_parallel_size, with lathe's data-parallel part 1: the MoE layers of a replica run
    expert-parallel over its ranks (`lathe.engine.expert_parallel`); any other size is refused."""
    two = ["trainer.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2"]
    assert load(*two, f"{R}.expert_parallel_size=2", device_count=2).actor_rollout_ref.rollout.expert_parallel_size == 2
    with pytest.raises(ConfigError, match=r"expert_parallel_size=4: .* Fix: set it to "
                                          r"tensor_model_parallel_size=2, or 1"):
        load(*two, f"{R}.expert_parallel_size=4", device_count=2)


@pytest.mark.parametrize("override", [
    "full_determinism=true", "seed=7", "scheduling_policy=priority", "prometheus.enable=true",
    "moe_load_balance_metrics_interval=10", "multi_turn.num_repeat_rollouts=2", "agent.num_workers=4",
    "checkpoint_engine.engine_kwargs={nccl: {x: 1}}"])
def test_keys_with_no_effect_warn(override):
    with pytest.warns(IgnoredKeysWarning, match=re.escape(override.split("=")[0].split(".")[0])):
        load(f"{R}.{override}")


def test_keys_at_lathes_behaviour_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(f"{R}.logprobs_mode=processed_logprobs", f"{R}.nnodes=0", f"{R}.n_gpus_per_node=1",
             f"{R}.seed=42", f"{R}.mtp={{enable: true}}", f"{R}.agent.default_agent_loop=single_turn_agent")


def _script(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("--config")]


def _key(problem: str) -> str:
    match = re.match(r"\s*(?:\d+\.\s*)?(?:Unknown config key )?`?\+*([\w.\-]+)`?\s*[=(:]", problem)
    return match.group(1) if match else ""


def _problems(items: list[str]) -> list[str]:
    """load_config's problems; unknown keys outside the rollout group are dropped and the script loaded again
    (they stop load_config before its later checks)."""
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_config("base", items, device_count=8)
            return []
        except ConfigError as err:
            problems = [p for p in re.split(r"\n(?=\s*\d+\. )", str(err)) if p.strip()]
        unknown = {_key(p) for p in problems if "Unknown config key" in p and not _key(p).startswith(R)}
        if not unknown:
            return problems
        items = [i for i in items if i.lstrip("+").split("=")[0] not in unknown]


# the trainer's token budget with use_dynamic_bsz (rules.py), not an engine key
NOT_ENGINE = ("log_prob_max_token_len_per_gpu",)


def test_verl_scripts_fail_on_rollout_keys_only_for_named_features():
    scripts = sorted(SCRIPTS.glob("*.txt"))
    if not scripts:
        pytest.skip("no verl script corpus")
    unnamed = {}
    for path in scripts:
        bad = [p for p in _problems(_script(path)) if _key(p).startswith(R)
               and "lathe issue 4" not in p and not _key(p).endswith(NOT_ENGINE)]
        if bad:
            unnamed[path.stem] = bad
    assert unnamed == {}


@pytest.mark.parametrize(("override", "outcome"), [
    ("repetition_penalty=1.1", "refuse"), ("checkpoint_manager_class=my.Manager", "refuse"),
    ("standalone_gpu_memory_utilization=0.9", "warn"), ("enable_sleep_mode=false", "warn"),
    ("limit_images=2", "warn"), ("server.timeout=30", "warn"), ("sglang_engine_mode=remote", "warn"),
    ("layer_name_map={a: b}", "warn"), ("custom={x: 1}", "warn"), ("standalone_gpu_memory_utilization=1.5", "refuse"),
])
def test_verl_dataclass_only_fields_are_known(override, outcome):
    """verl's RolloutConfig fields that its YAML leaves out (scripts set them with +key=...)."""
    key = f"{R}.{override.split('=')[0]}"
    if outcome == "refuse":
        with pytest.raises(ConfigError, match=re.escape(key)), warnings.catch_warnings():
            warnings.simplefilter("ignore", IgnoredKeysWarning)
            load(f"+{R}.{override}")
    else:
        with pytest.warns(IgnoredKeysWarning, match=re.escape(key)):
            load(f"+{R}.{override}")


@pytest.mark.parametrize("overrides", [
    ("trainer.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2"),
    ("trainer.n_gpus_per_node=8", f"{R}.tensor_model_parallel_size=4", f"{R}.name=vllm"),
    ("trainer.nnodes=2", "trainer.n_gpus_per_node=8", f"{R}.tensor_model_parallel_size=16"),   # whole nodes
    ("trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2"),   # fully async
    ("trainer.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2", f"{R}.multi_turn.enable=true"),   # agent loop
    ("trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2",
     f"{R}.multi_turn.enable=true"),
])
def test_tensor_parallel_replicas_load(overrides):
    cfg = load(*overrides)
    assert run_plan(cfg).rollout_replicas == run_plan(cfg).world // cfg.actor_rollout_ref.rollout.tensor_model_parallel_size


@pytest.mark.parametrize(("overrides", "message"), [
    (("trainer.n_gpus_per_node=4", f"{R}.tensor_model_parallel_size=3"), "spans devices of one node"),
    (("trainer.nnodes=3", "trainer.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=4"), "whole nodes"),
    (("trainer.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=2", f"{R}.name=hf"), "transformers' generate"),
    (("trainer.n_gpus_per_node=4", "rollout.n_gpus_per_node=3", f"{R}.tensor_model_parallel_size=2"),
     "rollout.n_gpus_per_node=3"),          # fully async: the rollout pool's devices form the replicas
    (("rollout.nnodes=3", "rollout.n_gpus_per_node=2", f"{R}.tensor_model_parallel_size=4"), "rollout.nnodes"),
])
def test_tensor_parallel_replicas_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(*overrides)


@pytest.mark.parametrize(("devices", "overrides", "ep"), [
    (4, ["moe_tensor_parallel_size=2", "tensor_model_parallel_size=4", "expert_parallel_size=2"], 4),
    (4, ["data_parallel_size=2", "tensor_model_parallel_size=2", "expert_parallel_size=2"], 2),
])
def test_verl_engine_layouts_run_as_replicas_of_tp_ranks(devices, overrides, ep):
    """TensorRT-LLM's moe_tensor_parallel_size x EP = TP runs as whole experts over the TP ranks, and a data-parallel
    size with EP = TP as replicas of whole experts: the same samples, another layout, one notice each."""
    with pytest.warns(IgnoredKeysWarning, match="runs as|places whole experts"):
        cfg = load_config("base", [f"trainer.n_gpus_per_node={devices}", *(f"{R}.{o}" for o in overrides)],
                          device_count=devices)
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == ep


@pytest.mark.parametrize(("devices", "overrides"), [
    (8, ["data_parallel_size=8", "expert_parallel_size=8"]),
    (4, ["data_parallel_size=2", "tensor_model_parallel_size=2", "expert_parallel_size=4"])])
def test_verl_data_parallel_attention_is_kept(devices, overrides):
    """verl's EP = TP x DP is data-parallel attention (`lathe.engine.data_parallel`): kept as written, no notice."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeysWarning)
        cfg = load_config("base", [f"trainer.n_gpus_per_node={devices}", *(f"{R}.{o}" for o in overrides)],
                          device_count=devices)
    ro = cfg.actor_rollout_ref.rollout
    assert ro.data_parallel_size * ro.tensor_model_parallel_size == ro.expert_parallel_size == devices


def test_wide_expert_parallel_reads_as_data_parallel_attention():
    with pytest.warns(IgnoredKeysWarning, match=r"verl requires EP = TP x data_parallel_size .* reads it as "
                                                r"data_parallel_size=4 \(data-parallel attention: 4 engine replicas "
                                                r"of 2 rank"):
        cfg = load_config("base", ["trainer.n_gpus_per_node=8", f"{R}.tensor_model_parallel_size=2",
                                   f"{R}.expert_parallel_size=8"], device_count=8)
    ro = cfg.actor_rollout_ref.rollout
    assert (ro.data_parallel_size, ro.expert_parallel_size) == (4, 8)
    with pytest.raises(ConfigError, match="expert_parallel_size=8: expert-parallel generation over other"):
        load_config("base", ["trainer.n_gpus_per_node=4", f"{R}.tensor_model_parallel_size=2",
                             f"{R}.expert_parallel_size=8"], device_count=4)      # 8 ranks do not divide 4 devices


def test_engine_layouts_that_do_not_fit_are_refused():
    with pytest.raises(ConfigError, match=r"data_parallel_size`=3 .* needs 3 to divide the 4 rollout devices"):
        load_config("base", ["trainer.n_gpus_per_node=4", f"{R}.data_parallel_size=3"], device_count=4)
    with pytest.raises(ConfigError, match=r"moe_tensor_parallel_size`=2 with expert_parallel_size=1"):
        load_config("base", ["trainer.n_gpus_per_node=4", f"{R}.tensor_model_parallel_size=4",
                             f"{R}.moe_tensor_parallel_size=2"], device_count=4)



def test_data_parallel_attention_setting_picks_the_layout_or_is_refused():
    """lathe's `rollout.data_parallel_attention`: never runs verl's EP = TP x DP as replicas of whole experts (a
    notice), always keeps data-parallel attention and is refused where it cannot run (no engine of several replicas,
    EP not D x TP, FP8 rollout) rather than ignored; auto is decided with the memory plan (tests/train/test_memory).
    The agent loop runs on it, on replicas of one rank or of several (tests/rollout/agent/test_agent_data_parallel)."""
    dp = ["trainer.n_gpus_per_node=4", f"{R}.data_parallel_size=2", f"{R}.tensor_model_parallel_size=2",
          f"{R}.expert_parallel_size=4"]
    with pytest.warns(IgnoredKeysWarning, match=r"data_parallel_attention=never\): expert_parallel_size 4 runs as 2"):
        cfg = load_config("base", [*dp, f"{R}.data_parallel_attention=never"], device_count=4)
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 2
    cfg = load_config("base", [*dp, f"{R}.data_parallel_attention=always"], device_count=4)
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 4
    for overrides, message in (([f"{R}.expert_parallel_size=2"], "needs expert_parallel_size = 4"),
                               ([f"{R}.quantization=fp8"], "does not run with FP8 rollout")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("base", [*dp, f"{R}.data_parallel_attention=always", *overrides], device_count=4)
    with pytest.raises(ConfigError, match=r"data_parallel_attention=always` with data_parallel_size=1: no engine"):
        load_config("base", [f"{R}.data_parallel_attention=always"])
    one_rank = ["trainer.n_gpus_per_node=2", f"{R}.data_parallel_size=2", f"{R}.expert_parallel_size=2"]
    cfg = load_config("base", [*one_rank, f"{R}.multi_turn.enable=true", f"{R}.data_parallel_attention=always"],
                      device_count=2)       # the agent loop on replicas of one rank: in the replicas' lockstep
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 2
    cfg = load_config("base", [*dp, f"{R}.multi_turn.enable=true", f"{R}.data_parallel_attention=always"],
                      device_count=4)       # ... and of two ranks: the leaders in lockstep, their followers following
    assert cfg.actor_rollout_ref.rollout.expert_parallel_size == 4
