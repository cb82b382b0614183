"""`lathe generate` with tools: the multi-turn tool loop of `lathe train` (`lathe.rollout.agent.loop`), offline.

    lathe generate MODEL_DIR IN.jsonl OUT.jsonl tool_config_path=TOOLS.yaml [tool_format=hermes ...]

`tool_config_path` is verl's tool config (``tools: [{class_name, config, tool_schema}]``, as `lathe train` reads it),
`function_tool_path` a Python file of `@function_tool` functions (`lathe.rollout.agent.function_tools`); either turns
the loop on, and the other keys are verl's `rollout.multi_turn.*` settings (`tool_format` is its `format`) and act only
with a tool file. Each sample is then a trajectory: the model's turns, and after each turn that calls tools the calls'
answers, appended exactly as the chat template renders them, until the model answers without a call, a turn cap ends it,
or `max_tokens` (the response budget of all turns together, tool answers included) runs out. A chat prompt is rendered
with the tools' schemas (``apply_chat_template(tools=...)``); a ``prompt`` string or ``prompt_token_ids`` row is used as
given, with no tools rendered into it. A row may carry verl's ``"extra_info": {"tools_kwargs": {TOOL: {"create_kwargs":
{...}}}}`` for its tools' instances. Besides EOS and `stop_token_ids`, the template's end-of-turn token ends a turn.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lathe.cli.generate_options import GenerateError, GenerateOptions, check_tool_options
from lathe.cli.generate_rows import PromptRow

log = logging.getLogger("lathe")

KWARGS_FIX = 'write "extra_info": {"tools_kwargs": {"TOOL_NAME": {"create_kwargs": {...}}}} (verl\'s layout)'


def load_toolset(opts: GenerateOptions):
    """The run's `ToolSet` (`tool_config_path`'s tools and `function_tool_path`'s functions), or None without
    either; a missing or bad file is a GenerateError naming it."""
    check_tool_options(opts)                    # again for options built in code (parse_options checks the keys given)
    if not opts.tool_config_path and not opts.function_tool_path:
        return None
    from lathe.rollout.agent import combined_tools
    from lathe.rollout.agent.tools import ToolConfigError
    path = None
    if opts.tool_config_path:
        builtin = opts.tool_config_path.startswith("builtin:")             # a tool config shipped with lathe
        path = opts.tool_config_path if builtin else Path(opts.tool_config_path).expanduser()
        if not builtin and not path.is_file():
            raise GenerateError(f"tool_config_path={opts.tool_config_path}: no such file. Fix: give a tool YAML file "
                                "in verl's shape (tools: [{class_name, config, tool_schema}]), e.g. with class_name: "
                                "lathe.rollout.agent.builtin_tools.CalculatorTool")
    try:
        return combined_tools(path, opts.function_tool_path, function_key="function_tool_path")
    except ToolConfigError as e:
        raise GenerateError(f"tools: {e}") from None


def rows_tools_kwargs(rows: list[PromptRow], toolset) -> list[dict | None]:
    """Each row's ``extra_info["tools_kwargs"]`` (None where it has none), its shape checked; tool names the tool file
    does not define are logged once (their kwargs are unused)."""
    out, unknown = [], set()
    for row in rows:
        kwargs = _tools_kwargs(row)
        unknown |= set(kwargs or ()) - set(toolset.tools)
        out.append(kwargs)
    if unknown:
        log.warning("extra_info.tools_kwargs names tools the tool file does not define (%s; it defines %s): their "
                    "kwargs are unused", ", ".join(sorted(unknown)), ", ".join(sorted(toolset.tools)))
    return out


def note_plain_prompts(rows: list[PromptRow]) -> None:
    """Log once how many rows are not chat messages (their prompts get no tool schemas)."""
    plain = sum(1 for r in rows if r.field != "prompt" or isinstance(r.value, str))
    if plain:
        log.warning("%d of %d rows are not chat messages: their prompts are used as given, with no tool schemas "
                    "rendered into them", plain, len(rows))


def _tools_kwargs(row: PromptRow) -> dict | None:
    info = row.extra_info
    if info is None:
        return None
    if not isinstance(info, dict):
        raise GenerateError(f"{row.where}: field 'extra_info': expected a JSON object, got "
                            f"{type(info).__name__}. Fix: {KWARGS_FIX}")
    kwargs = info.get("tools_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise GenerateError(f"{row.where}: field 'extra_info.tools_kwargs': expected a JSON object of tool names, got "
                            f"{str(kwargs)[:80]}. Fix: {KWARGS_FIX}")
    for name, entry in kwargs.items():
        if entry is not None and not isinstance(entry, dict):
            raise GenerateError(f"{row.where}: field 'extra_info.tools_kwargs.{name}': expected a JSON object "
                                f"(create_kwargs, execute_kwargs, ...), got {str(entry)[:80]}. Fix: {KWARGS_FIX}")
        for key, value in (entry or {}).items():
            if value is not None and not isinstance(value, dict):
                raise GenerateError(f"{row.where}: field 'extra_info.tools_kwargs.{name}.{key}': expected a JSON "
                                    f"object of keyword arguments, got {str(value)[:80]}. Fix: {KWARGS_FIX}")
    return kwargs


def build_renderer(tokenizer, toolset):
    """The chat template's tool-turn renderer; a template that cannot render tool turns is a GenerateError."""
    from lathe.rollout.agent.render import ConversationRenderer, TemplateError
    if not getattr(tokenizer, "chat_template", None):
        raise GenerateError("tool_config_path: the tool loop appends tool answers as the chat template renders them, "
                            "but the tokenizer has no chat template. Fix: use a chat model's tokenizer, or drop "
                            "tool_config_path")
    try:
        return ConversationRenderer(tokenizer, tools=toolset.schemas())
    except TemplateError as e:
        raise GenerateError(f"tool_config_path: {e}") from None


def check_room(rows: list[PromptRow], prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
    """A trajectory's later turns are asked with the whole conversation: prompt + max_tokens must fit the model."""
    for row, p in zip(rows, prompts):
        if len(p) + max_tokens > max_model_len:
            raise GenerateError(f"{row.where}: field '{row.field}': the prompt is {len(p)} tokens; with tools, prompt "
                                f"+ max_tokens={max_tokens} must fit max_model_len={max_model_len} (later turns "
                                "carry the whole conversation). Fix: lower max_tokens or raise max_model_len")


class ToolSetup:
    """The tool side of one run, each part checked before the weights load: the tools (`load`), each row's
    tools_kwargs (`check_rows`), the chat template's tool turns (`check_tokenizer`), the prompts' room to grow."""

    def __init__(self, opts: GenerateOptions, toolset):
        self.opts, self.toolset = opts, toolset
        self.tools_kwargs: list[dict | None] = []
        self.renderer = None

    @classmethod
    def load(cls, opts: GenerateOptions) -> ToolSetup | None:
        """None without `tool_config_path` (single-turn generation)."""
        toolset = load_toolset(opts)
        return None if toolset is None else cls(opts, toolset)

    def check_rows(self, rows: list[PromptRow]) -> None:
        self.tools_kwargs = rows_tools_kwargs(rows, self.toolset)
        note_plain_prompts(rows)

    def check_tokenizer(self, tokenizer) -> list[dict]:
        """The tools' schemas, for rendering chat prompts, once the template is known to render tool turns."""
        self.renderer = build_renderer(tokenizer, self.toolset)
        return self.toolset.schemas()

    def check_prompts(self, rows: list[PromptRow], prompts: list[list[int]], max_model_len: int) -> None:
        check_room(rows, prompts, self.opts.sampling.max_tokens, max_model_len)

    def runner(self, engine, tokenizer) -> ToolRunner:
        return ToolRunner(engine, tokenizer, self.opts, self.toolset, self.renderer, self.tools_kwargs)


class ToolRunner:
    """The engine calls of `lathe generate` through the agent loop, and the fields each sample gains."""

    def __init__(self, engine, tokenizer, opts: GenerateOptions, toolset, renderer, tools_kwargs: list):
        from lathe.rollout.agent.loop import AgentLoop, AgentSettings
        from lathe.rollout.agent.parser import get_parser
        settings = AgentSettings(
            response_length=opts.sampling.max_tokens, max_assistant_turns=opts.max_assistant_turns,
            max_user_turns=opts.max_user_turns, max_parallel_calls=opts.max_parallel_calls,
            max_tool_response_length=opts.max_tool_response_length,
            tool_response_truncate_side=opts.tool_response_truncate_side, tool_timeout_s=opts.tool_timeout)
        self.loop = AgentLoop(engine, tokenizer, settings, tools=toolset, parse=get_parser(opts.tool_format),
                              renderer=renderer)
        self.tools_kwargs = tools_kwargs

    def generate(self, prompts: list[list[int]], params, lo: int, hi: int):
        """Prompts lo..hi's trajectories, seeded as `LatheEngine.generate(prompts[lo:hi], params)` samples."""
        return self.loop.generate(prompts[lo:hi], params, tools_kwargs=self.tools_kwargs[lo:hi],
                                  request_prefix="generate")

    @staticmethod
    def fields(out, k: int) -> dict:
        """Sample k's loss mask (1 = the model's own tokens) and tool record."""
        return {"loss_mask": out.loss_masks[k], "num_turns": out.num_turns[k], "tool_calls": out.tool_calls[k],
                "tool_errors": out.tool_errors[k], "tool_rewards": out.tool_rewards[k]}
