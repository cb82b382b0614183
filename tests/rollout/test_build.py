"""Building the rollout backend from `actor_rollout_ref.rollout`: the backend chosen for verl's backend names, its
one notice, and the engine keys reaching lathe's engine."""

from __future__ import annotations

import logging

import pytest
import torch

from lathe.config import load_config
from lathe.models.hf import select_impl
from lathe.rollout.build import build_engine, resolve_rollout_name

R = "actor_rollout_ref.rollout"


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lathe runs its own engine" in r.getMessage()
            or "lathe does not run" in r.getMessage()]


@pytest.mark.parametrize(("name", "label"), [("vllm", "vLLM"), ("sglang", "SGLang"), ("trtllm", "TensorRT-LLM")])
def test_verl_backend_runs_lathes_engine_with_one_notice(make_model, caplog, name, label):
    actor = select_impl(make_model(), "auto")
    with caplog.at_level(logging.INFO, logger="lathe"):
        assert resolve_rollout_name(name, actor, impl="auto") == "lathe"
    notices = _notices(caplog)
    assert len(notices) == 1 and notices[0].startswith("rollout: lathe engine")
    assert f"{R}.name={name}: lathe runs its own engine, not {label}" in notices[0]
    assert f"engine_kwargs.{name}" in notices[0]


def test_verl_backend_on_a_transformers_actor_generates_with_transformers(make_model, caplog):
    with caplog.at_level(logging.INFO, logger="lathe"):
        assert resolve_rollout_name("vllm", make_model(), impl="hf") == "hf"
    notices = _notices(caplog)
    assert len(notices) == 1 and "transformers generate" in notices[0] and "Qwen2ForCausalLM" in notices[0]


def test_lathe_and_auto_log_no_backend_notice(make_model, caplog):
    actor = select_impl(make_model(), "auto")
    with caplog.at_level(logging.INFO, logger="lathe"):
        assert resolve_rollout_name("auto", actor, impl="auto") == "lathe"
        assert resolve_rollout_name("lathe", actor, impl="auto") == "lathe"
    assert _notices(caplog) == []


def _engine(make_model, *overrides: str, device: str = "cpu"):
    lengths = ["data.max_prompt_length=32", "data.max_response_length=32"]
    cfg = load_config("base", [*lengths, f"{R}.name=vllm", *overrides]).actor_rollout_ref.rollout
    actor = select_impl(make_model(), "auto").to(device)
    return build_engine(cfg, actor, [0])


def test_engine_keys_and_engine_kwargs_reach_the_engine(make_model):
    engine = _engine(make_model, f"+{R}.engine_kwargs.vllm.max_num_batched_tokens=96",
                     f"+{R}.engine_kwargs.vllm.max_num_seqs=5", f"{R}.enable_prefix_caching=false",
                     f"+{R}.engine_kwargs.vllm.enable_chunked_prefill=false", f"{R}.max_model_len=100")
    assert engine.scheduler.max_num_batched_tokens == 96 and engine.scheduler.max_num_seqs == 5
    assert engine.scheduler.enable_chunked_prefill is False
    assert engine.block_manager.enable_prefix_caching is False
    assert engine.max_model_len == engine.runner.max_model_len == 100


@pytest.mark.parametrize("override", [f"+{R}.engine_kwargs.vllm.kv_cache_dtype=fp8", f"{R}.kv_cache_dtype=fp8_e4m3"])
def test_an_fp8_kv_cache_reaches_the_engine(make_model, override):
    from lathe.engine.kv_cache import FP8
    engine = _engine(make_model, override)
    assert engine.kv_cache.dtype is FP8 and engine.kv_cache.scales is not None
    assert _engine(make_model).kv_cache.dtype is not FP8


@pytest.mark.gpu
def test_enforce_eager_and_capture_sizes_reach_the_engines_graphs(make_model):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    assert _engine(make_model, f"{R}.enforce_eager=true", device="cuda").runner.graphs is None
    assert _engine(make_model, f"+{R}.engine_kwargs.vllm.compilation_config.cudagraph_mode=NONE",
                   device="cuda").runner.graphs is None
    sized = _engine(make_model, f"+{R}.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes=[4,2,8]",
                    f"{R}.max_num_seqs=6", device="cuda")
    assert sized.runner.graphs.buckets == [2, 4, 6]          # capped at the engine's batch
    assert _engine(make_model, device="cuda").runner.graphs.buckets[:4] == [1, 2, 4, 8]


def test_a_rollout_pools_engine_takes_standalone_gpu_memory_utilization(make_model, monkeypatch):
    import lathe.rollout.build as build
    seen = []
    monkeypatch.setattr(build, "LatheEngine", lambda model, **kw: seen.append(kw["gpu_memory_utilization"]))
    with pytest.warns(UserWarning, match="standalone_gpu_memory_utilization"):     # colocated: no effect
        cfg = load_config("base", [f"{R}.gpu_memory_utilization=0.4",
                                   f"{R}.standalone_gpu_memory_utilization=0.8"]).actor_rollout_ref.rollout
    actor = select_impl(make_model(), "auto")
    build_engine(cfg, actor, [0])
    build_engine(cfg, actor, [0], standalone=True)
    assert seen == [0.4, 0.8]
