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

Keys are `SamplingParams`' fields (vLLM's names) plus engine settings (`lathe.cli.generate_options`). With a `seed` the samples are
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
import time
from dataclasses import dataclass
from pathlib import Path

from lathe.cli.generate_options import GenerateError, GenerateOptions, parse_options
from lathe.cli.generate_rows import read_rows, tokenize_rows
from lathe.cli.generate_tools import ToolSetup
from lathe.track.progress import Progress

log = logging.getLogger("lathe")


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
    decode, params = text_decoder(tokenizer), opts.sampling
    n = params.n
    stats = GenerateStats(prompts=len(rows), samples=len(rows) * n, tokens=0, seconds=0.0, tools=runner is not None)
    call = runner.generate if runner else lambda ps, p, lo, hi: engine.generate(ps[lo:hi], p)
    bar = Progress("generate", len(rows), unit="prompt", every_s=0)   # a live line, or a log line per engine call
    start = time.perf_counter()
    with open(output_path, "w", encoding="utf-8") as f, bar:
        for lo in range(0, len(rows), opts.prompts_per_call):
            hi = min(lo + opts.prompts_per_call, len(rows))
            out = call(prompts, dataclasses.replace(params, seed=_call_seed(params.seed, lo)), lo, hi)
            for i in range(lo, hi):
                samples = [_sample(out, k, params.stop, decode, runner, stats) for k in range((i - lo) * n,
                                                                                            (i - lo + 1) * n)]
                row = {"index": i, rows[i].field: rows[i].value, "outputs": samples}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            stats.seconds = time.perf_counter() - start
            bar.update(hi, f"{stats.tokens} tokens, {stats.tokens_per_second:.1f} tok/s")
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
