"""verl's inference-backend arguments on lathe's engine: ``actor_rollout_ref.rollout.engine_kwargs.<backend>``.

verl hands ``engine_kwargs.<rollout.name>`` to vLLM, SGLang or TensorRT-LLM as engine arguments. lathe runs its
own engine in their place, so an entry of the named backend acts where lathe's engine has the same setting:
``apply_engine_kwargs`` sets the ``rollout`` key the engine reads (one truth: the engine reads only ``rollout.*``,
and ``--print-config`` shows the setting there), before the checks. ``engine_kwargs_verdict`` (the registry's
judge of ``engine_kwargs``) refuses entries that ask for a feature lathe lacks and names the others, which have
no effect, in the run's one warning. The other backends' entries are not read (as in verl).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, get_args

from .choices import KVCacheDtype
from .coerce import show
from .errors import ConfigError, ProblemList
from .tree import Assignment, assign, get_path

R = "actor_rollout_ref.rollout"
BACKENDS = ("vllm", "sglang", "trtllm")
QUANTIZED = ("quantized rollout other than FP8 weights and an FP8 KV cache (torchao schemes, block scales: lathe "
             "issue 48)")
KV_CACHE_DTYPES = get_args(KVCacheDtype)
KV_CACHE = (f"a KV cache dtype other than {', '.join(KV_CACHE_DTYPES)} (lathe's FP8 cache is e4m3 with a scale per "
            "token and KV head; fp8_e5m2 and fp8_inc are not implemented: lathe issue 48)")
SPECULATIVE = ("speculative decoding configured through the engine's own keys (separate draft models, EAGLE3, "
               "n-gram; lathe drafts with the checkpoint's MTP layers: actor_rollout_ref.model.mtp.enable_rollout)")


def _to(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {key: convert(v)}


def _sglang_chunked_prefill(size: Any) -> dict[str, Any]:
    """SGLang's chunked_prefill_size: the prefill token budget; -1 (or null) turns chunking off."""
    if size is None or size <= 0:
        return {"enable_chunked_prefill": False}
    return {"max_num_batched_tokens": size}


def _vllm_cudagraph_mode(mode: Any) -> dict[str, Any]:
    """NONE turns graphs off; every other mode is what lathe does (full graphs of decode steps, eager prefill)."""
    return {"enforce_eager": True} if str(mode).upper() == "NONE" else {}


# backend -> {entry (dotted, inside engine_kwargs.<backend>): value -> {rollout key: value}}
ACTS: dict[str, dict[str, Callable[[Any], dict[str, Any]]]] = {
    "vllm": {**{k: _to(k) for k in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
                                    "max_model_len", "enable_chunked_prefill", "enable_prefix_caching",
                                    "enforce_eager")},
             "cuda_graph_sizes": _to("cudagraph_capture_sizes"),
             "compilation_config.cudagraph_capture_sizes": _to("cudagraph_capture_sizes"),
             "compilation_config.cudagraph_mode": _vllm_cudagraph_mode,
             "mm_processor_cache_gb": lambda v: {},           # lathe keeps no processor cache: any size is fine
             "kv_cache_dtype": _to("kv_cache_dtype"),          # auto, fp8, fp8_e4m3 (others are refused below)
             "quantization": _to("quantization")},            # fp8 only (others are refused below)
    "sglang": {"mem_fraction_static": _to("gpu_memory_utilization"),
               "max_running_requests": _to("max_num_seqs"),
               "chunked_prefill_size": _sglang_chunked_prefill,
               "context_length": _to("max_model_len"),
               "disable_radix_cache": _to("enable_prefix_caching", lambda v: not v),
               "disable_cuda_graph": _to("enforce_eager"),
               "cuda_graph_bs": _to("cudagraph_capture_sizes"),
               "kv_cache_dtype": _to("kv_cache_dtype"),
               "quantization": _to("quantization")},
    "trtllm": {"max_batch_size": _to("max_num_seqs"),
               "max_num_tokens": _to("max_num_batched_tokens"),
               "max_seq_len": _to("max_model_len"),
               "enable_chunked_prefill": _to("enable_chunked_prefill")},
}

# entry -> (fine(value), the feature lathe lacks): a value that is not fine is refused
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "kv_cache_dtype": (lambda v: v is None or v in KV_CACHE_DTYPES, KV_CACHE),
    "quantization": (lambda v: not v or v == "fp8", QUANTIZED),
    "speculative_config": (lambda v: not v, SPECULATIVE),
    "speculative_algorithm": (lambda v: not v, SPECULATIVE),
}


def flat_entries(kwargs: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted entry, value) of a nested dict; null values are unset."""
    for key, value in (kwargs or {}).items():
        if isinstance(value, dict) and value:
            yield from flat_entries(value, f"{prefix}{key}.")
        elif value is not None and value != {}:
            yield f"{prefix}{key}", value


def _refused(entry: str, value: Any) -> str | None:
    top = entry.split(".")[0]
    if top in REFUSED and not REFUSED[top][0](value):
        return REFUSED[top][1]
    return None


def apply_engine_kwargs(cfg: Any, problems: ProblemList) -> None:
    """Set the rollout keys that the named backend's engine_kwargs entries mean; a rollout key set to another
    value as well is a problem (two spellings of one setting)."""
    name = get_path(cfg, f"{R}.name")
    defaults = type(get_path(cfg, R))()
    for entry, value in flat_entries(get_path(cfg, f"{R}.engine_kwargs").get(name) if name in BACKENDS else {}):
        act = ACTS[name].get(entry)
        if act is None or _refused(entry, value):
            continue
        spelled = f"{R}.engine_kwargs.{name}.{entry}"
        for key, new in act(value).items():
            current = getattr(get_path(cfg, R), key)
            if current != getattr(defaults, key) and current != new:
                problems.add(f"`{spelled}`={show(value)} and `{R}.{key}`={show(current)} are both set, but they are "
                             f"the same setting of lathe's engine. Fix: keep only one of them.")
                continue
            try:
                assign(cfg, Assignment(f"{R}.{key}", new, None, spelled, f"from {spelled}"))
            except ConfigError as err:
                problems.add(str(err))


def engine_kwargs_verdict(value: Any, cfg: Any) -> tuple[str, str] | None:
    """The registry's judge of engine_kwargs: ('refuse', ...) for a feature lathe lacks, ('warn', ...) naming
    every entry with no effect, None when every entry acts."""
    name = get_path(cfg, f"{R}.name")
    refused, ignored = [], []
    for backend, kwargs in (value or {}).items():
        entries = list(flat_entries(kwargs)) if isinstance(kwargs, dict) else [("", kwargs)] if kwargs else []
        for entry, v in entries:
            shown = f"{backend}.{entry}={show(v)}".replace(".=", "=")
            if backend != name:
                ignored.append(f"{shown} (read only with rollout.name={backend})")
            elif _refused(entry, v):
                refused.append(f"{shown} ({_refused(entry, v)})")
            elif entry not in ACTS[name]:
                ignored.append(shown)
    if refused:
        return "refuse", (f"`{R}.engine_kwargs`: {', '.join(refused)} is not implemented yet in lathe. Fix: remove "
                          f"{'it' if len(refused) == 1 else 'them'}.")
    if ignored:
        entries = "entry" if len(ignored) == 1 else "entries"
        return "warn", (f"`{R}.engine_kwargs` {entries} {', '.join(ignored)}: no effect in lathe, whose engine has no "
                        f"such setting.")
    return None
