"""`lathe generate`: offline batch generation with lathe's engine, JSON lines in, JSON lines out.

    lathe generate MODEL_DIR INPUT.jsonl OUTPUT.jsonl [key=value ...]

An input row holds one of
    {"prompt": "text"}                                   tokenized as is (the tokenizer adds BOS etc., as vLLM does)
    {"prompt": [{"role": "user", "content": "..."}]}     the chat template, add_generation_prompt=True, then
                                                         tokenized without special tokens (verl's RLHFDataset)
    {"prompt_token_ids": [1, 2, 3]}                      used as is
and gives one output row, in input order:
    {"index": i, "prompt" | "prompt_token_ids": <as given>,
     "outputs": [{"token_ids", "text", "logprobs", "finish_reason"}, ... n of them]}

`text` is the decoded output (special tokens skipped); when a stop string ended it, it is cut just after the
stop string, while `token_ids`/`logprobs` run up to the token that completed it (see `lathe.generation.stop`).

Keys are vLLM's `SamplingParams` names plus engine settings (`GenerateOptions`). With a `seed` the samples are
reproducible for the same `batch_size` (the engine seeds each sample by its place in the call; each call gets
its own seed, so a prompt repeated in two calls gets fresh samples). Everything that can be
checked before the weights load is checked first: keys and values, every row, the architecture, then (with
the tokenizer) each prompt's length and token ids; errors name the file, the row and the field.

With `tool_config_path=TOOLS.yaml` a sample is a multi-turn, tool-calling trajectory (`lathe train`'s loop; see
`lathe.cli.generate_tools`): chat prompts are rendered with the tools' schemas, a row may add verl's
`"extra_info": {"tools_kwargs": {...}}`, `token_ids`, `logprobs` (0.0 on tokens the loop appended) and `text` run
over the whole trajectory, tool answers included, `max_tokens` is the budget of all its turns, and each output gains
    "loss_mask": [1 = the model's own token, 0 = appended], "num_turns", "tool_calls", "tool_errors",
    "tool_rewards": {tool name: its calc_reward}
Without a tool file the output has none of these fields.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_type_hints

from lathe.config.coerce import coerce, parse_value, spec
from lathe.config.errors import closest, did_you_mean

log = logging.getLogger("lathe")


class GenerateError(ValueError):
    """A bad key, value, input row or model directory for `lathe generate` (the message says which and the fix)."""


@dataclass
class GenerateOptions:
    """The `key=value` settings of `lathe generate`."""

    # sampling (vLLM's SamplingParams names)
    n: int = spec(1, "samples per prompt")
    temperature: float = spec(1.0, "sampling temperature; 0 = greedy")
    top_p: float = spec(1.0, "nucleus sampling mass; 1 = off")
    top_k: int = spec(-1, "sample from the k most likely tokens; -1 = off")
    max_tokens: int = spec(512, "new tokens per sample at most")
    min_tokens: int = spec(0, "new tokens before EOS, stop ids or stop strings may end a sample")
    seed: int | None = spec(None, "seed for reproducible sampling; null = a fresh seed")
    stop: list[str] = spec([], 'stop strings; one verbatim string, or a YAML list: stop=\'["\\n\\n", "###"]\'')
    stop_token_ids: list[int] = spec([], "token ids that end a sample (besides EOS)")
    ignore_eos: bool = spec(False, "keep generating past EOS and stop ids")
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
    tool_format: Literal["hermes", "llama3_json"] = spec("hermes", "tool calls in the model's text: hermes "
                                                                   "(Qwen2.5/Qwen3) or llama3_json (Llama 3.1+)")
    max_assistant_turns: int | None = spec(None, "model turns per trajectory at most; null = no cap")
    max_user_turns: int | None = spec(None, "tool-answer turns per trajectory at most; null = no cap")
    max_parallel_calls: int = spec(1, "tool calls run per model turn; later calls of a turn are dropped")
    max_tool_response_length: int = spec(256, "characters of one tool answer kept")
    tool_response_truncate_side: Literal["left", "right", "middle"] = spec(
        "middle", "which part of a long tool answer stays: left (the start), right (the end), middle (both ends)")
    tool_timeout: float = spec(30.0, "seconds a tool call may take; then the model reads a timeout error")

    def sampling_params(self):
        from lathe.generation import SamplingParams
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=self.max_tokens, min_tokens=self.min_tokens, seed=self.seed,
                              stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                              ignore_eos=self.ignore_eos)

    @property
    def prompts_per_call(self) -> int:
        return self.batch_size or max(1, 4 * self.max_num_seqs // self.n)


def parse_options(items: list[str]) -> GenerateOptions:
    """`["temperature=0", "n=4", ...]` -> checked `GenerateOptions` (unknown keys get a "did you mean")."""
    hints = get_type_hints(GenerateOptions)
    meta = {f.name: f.metadata for f in dataclasses.fields(GenerateOptions)}
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise GenerateError(f"{item!r} is not key=value. Fix: write settings as key=value, e.g. temperature=0")
        if key not in hints:
            raise GenerateError(f"unknown key {key!r}.{did_you_mean(closest(key, hints))} "
                                f"Known keys: {', '.join(hints)}")
        value = parse_value(raw)
        if key == "stop" and not raw.lstrip().startswith("["):
            value = [raw]                                  # one stop string, verbatim (YAML would eat "###")
        elif key == "stop_token_ids" and not isinstance(value, list):
            value = [value]
        values[key] = coerce(value, hints[key], key, raw=raw, meta=dict(meta[key]))
    opts = GenerateOptions(**values)
    _check_ranges(opts)
    from lathe.cli.generate_tools import check_tool_options
    check_tool_options(opts, set(values))
    return opts


def _check_ranges(o: GenerateOptions) -> None:
    rules = [
        (o.n >= 1, f"n={o.n}: need at least 1 sample per prompt"),
        (o.temperature >= 0, f"temperature={o.temperature}: must be >= 0 (0 = greedy)"),
        (0 < o.top_p <= 1, f"top_p={o.top_p}: must be in (0, 1]"),
        (o.top_k >= -1, f"top_k={o.top_k}: use -1 for off or a positive k"),
        (o.max_tokens >= 1, f"max_tokens={o.max_tokens}: must be >= 1"),
        (0 <= o.min_tokens <= o.max_tokens, f"min_tokens={o.min_tokens}: must be in [0, max_tokens={o.max_tokens}]"),
        (all(o.stop), "stop: an empty stop string would end every sample at once; remove it"),
        (all(t >= 0 for t in o.stop_token_ids), f"stop_token_ids={o.stop_token_ids}: token ids are >= 0"),
        (0 < o.gpu_memory_utilization <= 1, f"gpu_memory_utilization={o.gpu_memory_utilization}: must be in (0, 1]"),
        (o.max_num_seqs >= 1, f"max_num_seqs={o.max_num_seqs}: must be >= 1"),
        (o.max_model_len is None or o.max_model_len >= 2, f"max_model_len={o.max_model_len}: must be >= 2"),
        (o.batch_size is None or o.batch_size >= 1, f"batch_size={o.batch_size}: must be >= 1"),
    ]
    for ok, message in rules:
        if not ok:
            raise GenerateError(message)


# ---- input rows --------------------------------------------------------------------------------------


@dataclass
class PromptRow:
    where: str          # "FILE line N", for error messages
    field: str          # "prompt" or "prompt_token_ids"
    value: Any          # as given: a string, a list of messages, or a list of token ids
    extra_info: Any = None  # as given (verl's column; read with tools, for its "tools_kwargs")


def read_rows(path: str | Path) -> list[PromptRow]:
    """Every row of a JSON-lines file, checked; a bad row raises a GenerateError naming file, line and field."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GenerateError(f"input file not found: {path}. Fix: give a JSON-lines file, one prompt per line")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise GenerateError(f"{where}: not valid JSON ({e.msg}). Fix: one JSON object per line") from None
            rows.append(_check_row(row, where))
    if not rows:
        raise GenerateError(f"{path}: no rows. Fix: one JSON object per line, e.g. {{\"prompt\": \"Hello\"}}")
    return rows


def _check_row(row: Any, where: str) -> PromptRow:
    fix = 'give "prompt" (a string or a list of {"role", "content"} messages) or "prompt_token_ids" (a list of ints)'
    if not isinstance(row, dict):
        raise GenerateError(f"{where}: expected a JSON object, got {type(row).__name__}. Fix: {fix}")
    given = [k for k in ("prompt", "prompt_token_ids") if k in row]
    if len(given) != 1:
        problem = "has both 'prompt' and 'prompt_token_ids'" if given else f"has neither (keys: {sorted(row)})"
        raise GenerateError(f"{where}: row {problem}. Fix: {fix}")
    field, value = given[0], row[given[0]]
    if field == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            raise GenerateError(f"{where}: field 'prompt_token_ids': expected a non-empty list of token ids "
                                f"(ints >= 0), got {str(value)[:80]}")
    elif isinstance(value, str):
        if not value:
            raise GenerateError(f"{where}: field 'prompt': empty string. Fix: drop the row or fill in the text")
    elif isinstance(value, list) and value:
        for j, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                    and isinstance(m.get("content"), str)):
                raise GenerateError(f"{where}: field 'prompt[{j}]': expected a {{\"role\": str, \"content\": str}} "
                                    f"message, got {str(m)[:80]}")
    else:
        raise GenerateError(f"{where}: field 'prompt': expected a string or a non-empty list of messages, got "
                            f"{type(value).__name__} {str(value)[:60]}. Fix: {fix}")
    return PromptRow(where, field, value, row.get("extra_info"))


# ---- model directory ---------------------------------------------------------------------------------


def check_model_dir(model_dir: str | Path):
    """The checkpoint's `LatheConfig`, or a GenerateError when lathe's decoder cannot run it."""
    from lathe.models.config import SUPPORTED_ARCHITECTURES, LatheConfig, UnsupportedArchitecture
    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise GenerateError(f"{path}: not a Hugging Face checkpoint directory (no config.json). Fix: give a local "
                            "directory holding config.json, the *.safetensors weights and the tokenizer files")
    hint = (f"lathe generate runs lathe's own decoder and has no transformers fallback; `lathe model check {path}` "
            "shows what lathe supports of this checkpoint")
    try:
        cfg = LatheConfig.from_pretrained(path)
    except UnsupportedArchitecture as e:
        reason = str(e).replace("; the transformers fallback will be used", "")
        raise GenerateError(f"{reason}. {hint}") from None
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise GenerateError(f"{path}: {cfg.architecture} is not a causal LM (nothing to generate with). {hint}")
    return cfg


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(Path(model_dir).expanduser()), local_files_only=True)
    except (OSError, ValueError) as e:
        raise GenerateError(f"{model_dir}: could not load its tokenizer ({e}). Fix: save the model's tokenizer "
                            "there with tokenizer.save_pretrained(MODEL_DIR)") from None


def eos_token_ids(model_dir: str | Path, tokenizer) -> list[int]:
    """The tokenizer's EOS plus generation_config.json's `eos_token_id` (an int or a list), in that order."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    gen_cfg = Path(model_dir).expanduser() / "generation_config.json"
    if gen_cfg.is_file():
        extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids += [extra] if isinstance(extra, int) else list(extra or [])
    return list(dict.fromkeys(ids))


def tokenize_rows(rows: list[PromptRow], tokenizer, *, vocab_size: int, max_model_len: int,
                  tools: list[dict] | None = None) -> list[list[int]]:
    """Each row's prompt token ids, checked against the vocabulary and `max_model_len`; chat prompts are rendered
    with the `tools` schemas when given."""
    texts = {i: r.value for i, r in enumerate(rows) if isinstance(r.value, str)}
    chats = {i: _render_chat(r, tokenizer, tools) for i, r in enumerate(rows)
             if r.field == "prompt" and i not in texts}
    ids: dict[int, list[int]] = {i: list(r.value) for i, r in enumerate(rows) if r.field == "prompt_token_ids"}
    for group, special in ((texts, True), (chats, False)):
        if group:
            encoded = tokenizer(list(group.values()), add_special_tokens=special)["input_ids"]
            ids.update(zip(group, encoded))
    prompts = [list(ids[i]) for i in range(len(rows))]
    for row, p in zip(rows, prompts):
        if not p:
            raise GenerateError(f"{row.where}: field '{row.field}': the prompt has no tokens. Fix: give it text")
        if max(p) >= vocab_size:
            raise GenerateError(f"{row.where}: field '{row.field}': token id {max(p)} is outside the model's "
                                f"vocabulary (vocab_size={vocab_size})")
        if len(p) >= max_model_len:
            raise GenerateError(f"{row.where}: field '{row.field}': the prompt is {len(p)} tokens, not under "
                                f"max_model_len={max_model_len}. Fix: shorten it or raise max_model_len")
    return prompts


def _render_chat(row: PromptRow, tokenizer, tools: list[dict] | None = None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise GenerateError(f"{row.where}: field 'prompt' is a list of messages, but the tokenizer has no chat "
                            "template. Fix: give the prompt as a string, or use a chat model's tokenizer")
    try:
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(row.value, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as e:  # jinja raises TemplateError and friends
        raise GenerateError(f"{row.where}: field 'prompt': the chat template failed "
                            f"({type(e).__name__}: {e})") from None


# ---- the run -----------------------------------------------------------------------------------------


@dataclass
class GenerateStats:
    prompts: int
    samples: int
    tokens: int
    seconds: float
    tools: bool = False         # whether the tool loop ran (then the totals below count)
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def generate_file(model_dir: str | Path, input_path: str | Path, output_path: str | Path,
                  options: GenerateOptions | list[str] = ()) -> GenerateStats:
    """Generate for every row of `input_path` and write `output_path` (see the module docstring)."""
    from lathe.cli.generate_tools import ToolSetup
    opts = options if isinstance(options, GenerateOptions) else parse_options(list(options))
    tools = ToolSetup.load(opts)                # None without tool_config_path; a bad tool file fails here
    rows = read_rows(input_path)
    if tools:
        tools.check_rows(rows)
    output_path = Path(output_path).expanduser()
    if not output_path.parent.is_dir():
        raise GenerateError(f"output directory {output_path.parent} does not exist. Fix: create it first")
    if output_path.resolve() == Path(input_path).expanduser().resolve():
        raise GenerateError(f"the output {output_path} is the input file; give another path")
    cfg = check_model_dir(model_dir)
    max_model_len = opts.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise GenerateError(f"max_model_len={max_model_len} is beyond the model's max_position_embeddings="
                            f"{cfg.max_position_embeddings}. Fix: lower it or leave it unset")
    tokenizer = load_tokenizer(model_dir)
    schemas = tools.check_tokenizer(tokenizer) if tools else None
    prompts = tokenize_rows(rows, tokenizer, vocab_size=cfg.vocab_size, max_model_len=max_model_len, tools=schemas)
    if tools:
        tools.check_prompts(rows, prompts, max_model_len)
    engine = _load_engine(model_dir, opts, tokenizer, cfg)
    runner = tools.runner(engine, tokenizer) if tools else None
    return _run(engine, tokenizer, rows, prompts, opts, output_path, runner)


def _load_engine(model_dir, opts: GenerateOptions, tokenizer, cfg):
    import torch

    from lathe.device import default_device_type, device_count
    from lathe.engine.llm_engine import LatheEngine
    try:
        device = torch.device(default_device_type() if opts.device == "auto" else opts.device)
    except RuntimeError as e:
        raise GenerateError(f"device={opts.device!r}: {e}. Fix: e.g. device=cuda, device=cuda:1 or "
                            "device=cpu") from None
    if device.type != "cpu" and device_count(device.type) == 0:
        raise GenerateError(f"device={opts.device}: no {device.type} device is available. Fix: device=cpu")
    dtype_name = opts.dtype if opts.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32"
    start = time.perf_counter()
    engine = LatheEngine.from_pretrained(
        str(Path(model_dir).expanduser()), dtype=getattr(torch, dtype_name), device=device,
        eos_token_id=eos_token_ids(model_dir, tokenizer), tokenizer=tokenizer,
        gpu_memory_utilization=opts.gpu_memory_utilization, max_num_seqs=opts.max_num_seqs,
        max_model_len=opts.max_model_len, enable_prefix_caching=opts.enable_prefix_caching)
    log.info("loaded %s from %s (%s on %s) in %.1f s", cfg.architecture, model_dir, dtype_name, device,
             time.perf_counter() - start)
    return engine


def _run(engine, tokenizer, rows, prompts, opts: GenerateOptions, output_path: Path, runner=None) -> GenerateStats:
    """Generate `prompts` in engine calls of `opts.prompts_per_call` and write the rows; `runner`: the tool loop's
    `ToolRunner` (None: single-turn `engine.generate`)."""
    from lathe.generation.stop import text_decoder
    decode, params, n = text_decoder(tokenizer), opts.sampling_params(), opts.n
    stats = GenerateStats(prompts=len(rows), samples=len(rows) * n, tokens=0, seconds=0.0, tools=runner is not None)
    call = runner.generate if runner else lambda ps, p, lo, hi: engine.generate(ps[lo:hi], p)
    bar = _progress(len(rows))
    start = time.perf_counter()
    with open(output_path, "w", encoding="utf-8") as f:
        for lo in range(0, len(rows), opts.prompts_per_call):
            hi = min(lo + opts.prompts_per_call, len(rows))
            out = call(prompts, dataclasses.replace(params, seed=_call_seed(opts.seed, lo)), lo, hi)
            for i in range(lo, hi):
                samples = [_sample(out, k, opts.stop, decode, runner, stats) for k in range((i - lo) * n,
                                                                                            (i - lo + 1) * n)]
                row = {"index": i, rows[i].field: rows[i].value, "outputs": samples}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            stats.seconds = time.perf_counter() - start
            bar(hi, stats)
    tools = f", {stats.tool_calls} tool calls, {stats.tool_errors} tool errors" if stats.tools else ""
    log.info("generated %d prompts, %d samples, %d tokens%s in %.2f s (%.1f tok/s) -> %s", stats.prompts,
             stats.samples, stats.tokens, tools, stats.seconds, stats.tokens_per_second, output_path)
    return stats


def _sample(out, k: int, stop: list[str], decode, runner, stats: GenerateStats) -> dict:
    """Output sample `k` as written (see the module docstring), counted into `stats`."""
    from lathe.generation.stop import stop_text
    ids, reason = out.token_ids[k], out.finish_reasons[k]
    text = stop_text(ids, stop, decode) if reason == "stop" else decode(ids)
    sample = {"token_ids": ids, "text": text, "logprobs": out.logprobs[k], "finish_reason": reason}
    stats.tokens += len(ids)
    if runner is not None:
        sample.update(runner.fields(out, k))
        stats.tool_calls += sample["tool_calls"]
        stats.tool_errors += sample["tool_errors"]
    return sample


def _call_seed(seed: int | None, first_row: int) -> int | None:
    """The seed of the engine call starting at `first_row`: `seed` itself for the first call (so one call equals
    `LatheEngine.generate(..., seed=seed)`), a well-mixed derived seed for the others."""
    if seed is None or first_row == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{first_row}".encode()).digest()[:8], "little") >> 1


def _progress(total: int):
    """`update(done, stats)`: a tqdm bar on a terminal, else one log line per engine call."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=total, unit="prompt", file=sys.stderr)

        def update(done: int, stats: GenerateStats) -> None:
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{stats.tokens_per_second:.0f} tok/s")
            if done >= total:
                bar.close()
        return update

    def log_line(done: int, stats: GenerateStats) -> None:
        log.info("generate: %d/%d prompts, %d tokens, %.1f tok/s", done, total, stats.tokens,
                 stats.tokens_per_second)
    return log_line
