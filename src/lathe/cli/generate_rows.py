"""The input rows of `lathe generate`: read and checked (`read_rows`), then tokenized (`tokenize_rows`).

The row format is described in `lathe.cli.generate`; every error names the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lathe.cli.generate_options import GenerateError


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
