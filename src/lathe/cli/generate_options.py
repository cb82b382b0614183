"""The `key=value` settings of `lathe generate`: `GenerateOptions`, parsed and checked by `parse_options`.

The sampling keys are `SamplingParams`' own fields (`lathe.generation`): a key naming one is parsed by that
field's type and documented by its help, so a new sampling field is declared once, there. The engine and tool
keys are declared here. A `list[str]` key given without brackets is one verbatim string (`stop=###`; YAML
would eat it), a lone value for a `list[int]` key is a one-item list (`stop_token_ids=7`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

from lathe.config.coerce import coerce, parse_value, spec
from lathe.config.errors import closest, did_you_mean
from lathe.generation import SamplingParams

# where `lathe generate`'s default differs from `SamplingParams`' (an offline run wants whole answers)
SAMPLING_DEFAULTS = {"max_tokens": 512}

TOOL_KEYS = ("tool_format", "max_assistant_turns", "max_user_turns", "max_parallel_calls",
             "max_tool_response_length", "tool_response_truncate_side", "tool_timeout")


class GenerateError(ValueError):
    """A bad key, value, input row or model directory for `lathe generate` (the message says which and the fix)."""


@dataclass
class GenerateOptions:
    """The `key=value` settings of `lathe generate`: the sampling keys in `sampling`, the others as fields."""

    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(**SAMPLING_DEFAULTS))
    # engine
    dtype: Literal["auto", "bfloat16", "float32"] = spec("auto", "auto: bfloat16 on CUDA, float32 on CPU")
    device: str = spec("auto", "auto: cuda when available, else cpu")
    gpu_memory_utilization: float = spec(0.9, "fraction of GPU memory the model and KV cache may use")
    max_num_seqs: int = spec(256, "sequences decoded together at most")
    max_model_len: int | None = spec(None, "prompt + output tokens at most; null = the model's limit")
    enable_prefix_caching: bool = spec(True, "share the KV cache of common prompt prefixes")
    batch_size: int | None = spec(None, "prompts per engine call (progress is shown per call); "
                                        "null = enough for 4 * max_num_seqs samples")
    # tools (verl's rollout.multi_turn names; see lathe.cli.generate_tools); the others need tool_config_path
    tool_config_path: str | None = spec(None, "verl's tool YAML (tools: [{class_name, config, tool_schema}]): run "
                                              "the multi-turn tool loop; null = single-turn generation")
    function_tool_path: str | None = spec(None, "a Python file of @function_tool functions (lathe.rollout.agent."
                                                "function_tools): tools beside tool_config_path's, or alone")
    tool_format: Literal["hermes", "llama3_json"] = spec("hermes", "tool calls in the model's text: hermes "
                                                                   "(Qwen2.5/Qwen3) or llama3_json (Llama 3.1+)")
    max_assistant_turns: int | None = spec(None, "model turns per trajectory at most; null = no cap")
    max_user_turns: int | None = spec(None, "tool-answer turns per trajectory at most; null = no cap")
    max_parallel_calls: int = spec(1, "tool calls run per model turn; later calls of a turn are dropped")
    max_tool_response_length: int = spec(256, "characters of one tool answer kept")
    tool_response_truncate_side: Literal["left", "right", "middle"] = spec(
        "middle", "which part of a long tool answer stays: left (the start), right (the end), middle (both ends)")
    tool_timeout: float = spec(30.0, "seconds a tool call may take; then the model reads a timeout error")

    @property
    def prompts_per_call(self) -> int:
        return self.batch_size or max(1, 4 * self.max_num_seqs // self.sampling.n)


def _keys() -> dict[str, tuple[type, Any, bool]]:
    """Every key: (type, field metadata, whether it is a sampling field), the sampling keys first."""
    keys = {}
    for cls, sampling in ((SamplingParams, True), (GenerateOptions, False)):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "sampling":
                keys[f.name] = (hints[f.name], f.metadata, sampling)
    return keys


def parse_options(items: list[str]) -> GenerateOptions:
    """`["temperature=0", "n=4", ...]` -> checked `GenerateOptions` (unknown keys get a "did you mean")."""
    keys = _keys()
    sampling: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise GenerateError(f"{item!r} is not key=value. Fix: write settings as key=value, e.g. temperature=0")
        if key not in keys:
            raise GenerateError(f"unknown key {key!r}.{did_you_mean(closest(key, keys))} "
                                f"Known keys: {', '.join(keys)}")
        tp, meta, is_sampling = keys[key]
        value = _list_value(parse_value(raw), raw, tp)
        (sampling if is_sampling else values)[key] = coerce(value, tp, key, raw=raw, meta=dict(meta))
    opts = GenerateOptions(sampling=SamplingParams(**{**SAMPLING_DEFAULTS, **sampling}), **values)
    _check_ranges(opts)
    check_tool_options(opts, set(values))
    return opts


def _list_value(value: Any, raw: str, tp: Any) -> Any:
    """A `list[str]` key without brackets is one verbatim string; a lone value of a `list[int]` key one item."""
    if get_origin(tp) is not list:
        return value
    if get_args(tp) == (str,) and not raw.lstrip().startswith("["):
        return [raw]
    return value if isinstance(value, list) else [value]


def _check_ranges(o: GenerateOptions) -> None:
    s = o.sampling
    rules = [
        (s.n >= 1, f"n={s.n}: need at least 1 sample per prompt"),
        (s.temperature >= 0, f"temperature={s.temperature}: must be >= 0 (0 = greedy)"),
        (0 < s.top_p <= 1, f"top_p={s.top_p}: must be in (0, 1]"),
        (s.top_k >= -1, f"top_k={s.top_k}: use -1 for off or a positive k"),
        (s.max_tokens >= 1, f"max_tokens={s.max_tokens}: must be >= 1"),
        (0 <= s.min_tokens <= s.max_tokens, f"min_tokens={s.min_tokens}: must be in [0, max_tokens={s.max_tokens}]"),
        (all(s.stop), "stop: an empty stop string would end every sample at once; remove it"),
        (all(t >= 0 for t in s.stop_token_ids), f"stop_token_ids={s.stop_token_ids}: token ids are >= 0"),
        (0 < o.gpu_memory_utilization <= 1, f"gpu_memory_utilization={o.gpu_memory_utilization}: must be in (0, 1]"),
        (o.max_num_seqs >= 1, f"max_num_seqs={o.max_num_seqs}: must be >= 1"),
        (o.max_model_len is None or o.max_model_len >= 2, f"max_model_len={o.max_model_len}: must be >= 2"),
        (o.batch_size is None or o.batch_size >= 1, f"batch_size={o.batch_size}: must be >= 1"),
    ]
    for ok, message in rules:
        if not ok:
            raise GenerateError(message)


def check_tool_options(opts: GenerateOptions, given: set[str] | None = None) -> None:
    """The tool keys: each needs a tool file (`tool_config_path` or `function_tool_path`), and their ranges.
    `given`: the keys set (None: those that differ from their defaults)."""
    if given is None:
        default = GenerateOptions()
        given = {k for k in TOOL_KEYS if getattr(opts, k) != getattr(default, k)}
    if not opts.tool_config_path and not opts.function_tool_path:
        loose = [k for k in TOOL_KEYS if k in given]
        if loose:
            raise GenerateError(f"{loose[0]}={getattr(opts, loose[0])} needs tool_config_path or function_tool_path: "
                                f"the tool keys act only in the multi-turn tool loop, which a tool file turns on. Fix: "
                                f"add tool_config_path=TOOLS.yaml (or function_tool_path=TOOLS.py), or drop "
                                f"{', '.join(loose)}")
        return
    rules = [
        (opts.max_assistant_turns is None or opts.max_assistant_turns >= 1,
         f"max_assistant_turns={opts.max_assistant_turns}: must be >= 1, or null for no cap"),
        (opts.max_user_turns is None or opts.max_user_turns >= 1,
         f"max_user_turns={opts.max_user_turns}: must be >= 1, or null for no cap"),
        (opts.max_parallel_calls >= 1, f"max_parallel_calls={opts.max_parallel_calls}: must be >= 1"),
        (opts.max_tool_response_length >= 1,
         f"max_tool_response_length={opts.max_tool_response_length}: must be >= 1 (characters of one tool answer)"),
        (opts.tool_timeout > 0, f"tool_timeout={opts.tool_timeout}: must be > 0 (seconds)"),
    ]
    for ok, message in rules:
        if not ok:
            raise GenerateError(message)
