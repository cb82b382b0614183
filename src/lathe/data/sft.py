"""SFT examples: rows of verl's SFT data sets as token ids with a loss mask.

Two row shapes (verl's SFT datasets):

- **single-turn**: ``data.prompt_key`` holds the prompt (a string, taken as one user message, or a chat list)
  and ``data.response_key`` the response (a string); ``*_dict_keys`` read into struct columns (verl's GSM8K SFT
  recipe: ``prompt_key=extra_info prompt_dict_keys=[question]``). The prompt is rendered with the chat template
  and a generation prompt; the response's tokens and eos are trained. A response that is a list of messages
  (``builtin:secret_lookup``'s ``extra_info.answer``: a tool call, the tool's answer, the reply) continues the
  prompt's conversation, trained as the multi-turn rows are.
- **multi-turn**: ``data.messages_key`` holds a conversation (``[{role, content}, ...]``, optional tool schemas
  in ``data.tools_key``). The conversation is rendered with the chat template turn by turn: each assistant
  turn's tokens after its header (its content and end-of-turn marker) are trained, nothing else.

A row is multi-turn when ``data.multiturn.enable`` is set, or when it has the messages column and not the prompt
column. Every problem names the file, the row and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from lathe.data.dataset import _require_chat_template
from lathe.data.errors import DataError
from lathe.data.files import Columns, data_files, read_data_file


@dataclass
class SFTExample:
    """`prompt_ids`: the tokens before the first trained one (never trained); `response_ids` the rest, with
    `loss_mask` (1 = trained) over them; `origin` "file row i"."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    origin: str


class SFTDataset:
    """Map-style: every row validated, rendered and tokenized at construction (errors before a model loads)."""

    def __init__(self, files: str | list[str], tokenizer, data_cfg, *, split: str = "train", max_samples: int = -1):
        _require_chat_template(tokenizer)
        self.files = data_files(files)
        self.tokenizer, self.cfg = tokenizer, data_cfg
        self.num_truncated = 0
        self.examples: list[SFTExample] = []
        for path in self.files:
            src = os.path.expanduser(path)
            for where, row in read_data_file(path, split):
                if 0 <= max_samples <= len(self.examples):
                    break
                if not isinstance(row, dict):
                    raise DataError(f"{src} {where}: expected a JSON object / parquet row, got {type(row).__name__}")
                self.examples.append(self._example(row, f"{src} {where}"))
        if not self.examples:
            raise DataError(f"{self.files}: no rows. Fix: point data.{split}_files at a non-empty file.")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> SFTExample:
        return self.examples[i]

    # -- one row ----------------------------------------------------------------------------------------------
    def _example(self, row: dict, origin: str) -> SFTExample:
        d = self.cfg
        multi = d.multiturn.enable or (d.prompt_key not in row and d.messages_key in row)
        if multi:
            ids, mask = self._conversation(row, origin)
        else:
            ids, mask = self._single_turn(row, origin)
        if len(ids) > d.max_length:
            if d.truncation == "error":
                raise DataError(f"{origin}: {len(ids)} tokens after the chat template, more than data.max_length="
                                f"{d.max_length}. Fix: raise data.max_length, or set data.truncation=left|right to "
                                "cut such examples.")
            keep = slice(len(ids) - d.max_length, None) if d.truncation == "left" else slice(0, d.max_length)
            ids, mask = ids[keep], mask[keep]
            self.num_truncated += 1
        mask = [0, *mask[1:]]                    # the first token has no position before it to predict it
        if not any(mask):
            raise DataError(f"{origin}: no token to train on"
                            + (" after truncation" if len(ids) == d.max_length else "")
                            + " (the loss covers response / assistant tokens only). Fix: give the row a non-empty "
                              "response, or raise data.max_length.")
        first = mask.index(1)
        return SFTExample(ids[:first], ids[first:], mask[first:], origin)

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _single_turn(self, row: dict, origin: str) -> tuple[list[int], list[int]]:
        d = self.cfg
        prompt = _field(row, d.prompt_key, d.prompt_dict_keys, origin, "prompt")
        response = _field(row, d.response_key, d.response_dict_keys, origin, "response")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        messages = _messages(prompt, origin, d.prompt_key)
        if is_turns(response):
            return continuation_tokens(self.tokenizer, messages, response, origin, _where(d.response_key,
                                       d.response_dict_keys), dict(d.apply_chat_template_kwargs),
                                       ignore_mismatch=d.ignore_input_ids_mismatch)
        if isinstance(response, int | float) and not isinstance(response, bool):
            response = str(response)
        if not isinstance(response, str) or not response:
            raise DataError(f"{origin}: the response ({_where(d.response_key, d.response_dict_keys)}) must be a "
                            f"non-empty string, got {response!r}"[:300] + ". Fix: set data.response_key / "
                            "data.response_dict_keys to the column that holds the answer text.")
        prompt_ids = self._tokens(render(self.tokenizer, messages, origin, dict(d.apply_chat_template_kwargs),
                                         generation_prompt=True))
        response_ids = self._tokens(response) + [self.tokenizer.eos_token_id]
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def _conversation(self, row: dict, origin: str) -> tuple[list[int], list[int]]:
        """The conversation's tokens, rendered turn by turn; assistant content (after the header) is trained."""
        d = self.cfg
        if d.messages_key not in row:
            raise _no_column(origin, d.messages_key, "messages", f"row has {sorted(row)}")
        messages = _messages(row[d.messages_key], origin, d.messages_key, conversation=True)
        kwargs = {}
        tools = row.get(d.tools_key)
        if isinstance(tools, str) and tools.strip():
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as e:
                raise DataError(f"{origin}: '{d.tools_key}' is not valid JSON ({e.msg}).") from None
        if tools:
            kwargs["tools"] = tools
        thinking = row.get(d.enable_thinking_key, d.enable_thinking_default)
        if thinking not in (None, "none"):
            kwargs["enable_thinking"] = bool(thinking)
        return conversation_tokens(self.tokenizer, messages, origin, {**d.apply_chat_template_kwargs, **kwargs},
                                   ignore_mismatch=d.ignore_input_ids_mismatch)


def render(tokenizer, messages: list[dict], origin: str, template_kwargs: dict, *, generation_prompt: bool) -> str:
    """The chat template's text of `messages`; a DataError naming `origin` when the template fails."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                             **template_kwargs)
    except Exception as e:  # jinja raises TemplateError and friends
        raise DataError(f"{origin}: the chat template failed on this row ({type(e).__name__}: {e})") from None


def is_turns(response: Any) -> bool:
    """A response given as the turns that follow the prompt (a list of messages; a numpy array when read from
    parquet) rather than as text."""
    return isinstance(response, list) or getattr(response, "ndim", 0) == 1


def continuation_tokens(tokenizer, prompt: list[dict], turns: Any, origin: str, key: str, template_kwargs: dict, *,
                        ignore_mismatch: bool = False) -> tuple[list[int], list[int]]:
    """`conversation_tokens` of the prompt's messages followed by `turns` (messages with an assistant turn, read
    from `key`: a DataError names it when they are not)."""
    turns = _messages(turns, origin, key, conversation=True)
    return conversation_tokens(tokenizer, list(prompt) + turns, origin, template_kwargs,
                               ignore_mismatch=ignore_mismatch)


def conversation_tokens(tokenizer, messages: list[dict], origin: str, template_kwargs: dict, *,
                        ignore_mismatch: bool = False) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation rendered with the chat template turn by turn: 1 on each assistant
    turn's tokens after its header (its content and end-of-turn marker), 0 elsewhere. `lathe sft`'s conversations
    and `lathe train`'s warm start (`actor_rollout_ref.model.warm_start`) both train these."""
    def tokens(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def rendered(upto: int, generation_prompt: bool = False) -> str:
        return render(tokenizer, messages[:upto], origin, template_kwargs, generation_prompt=generation_prompt)

    # cut where an assistant turn starts and ends: only there must the rendering of a prefix of the conversation
    # be a prefix of the whole (templates may join other turns, e.g. Qwen's consecutive tool answers)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    cuts = sorted({*turns, *(i + 1 for i in turns), len(messages)} - {0})
    ids, mask, text, begin = [], [], "", 0
    for end in cuts:
        whole = rendered(end)
        if not whole.startswith(text):
            raise DataError(f"{origin}: the chat template renders turns 0..{begin - 1} differently once turns "
                            f"{begin}..{end - 1} follow (templates that rewrite earlier turns, e.g. drop their "
                            "<think> blocks, cannot be trained turn by turn). Fix: store the conversation as the "
                            "template renders it, or use a template that keeps earlier turns as they are.")
        trained = messages[begin]["role"] == "assistant"
        header = ""
        if trained:                      # the assistant header (the generation prompt) is not trained
            opened = rendered(begin, generation_prompt=True) if begin else ""
            if opened.startswith(text) and whole.startswith(opened):
                header = opened[len(text):]
        head_ids, body_ids = tokens(header), tokens(whole[len(text) + len(header):])
        ids += head_ids + body_ids
        mask += [0] * len(head_ids) + [int(trained)] * len(body_ids)
        text, begin = whole, end
    if ids != tokens(text) and not ignore_mismatch:
        raise DataError(f"{origin}: the conversation tokenized turn by turn differs from the whole conversation "
                        "tokenized at once (a token spans two turns). Fix: set data.ignore_input_ids_mismatch="
                        "true to train on the turn-by-turn tokens.")
    return ids, mask


def _where(key: str, dict_keys: list[str] | None) -> str:
    return ".".join([key, *(dict_keys or [])])


def _field(row: dict, key: str, dict_keys: list[str] | None, origin: str, what: str) -> Any:
    """`row[key][k1][k2]...`, or a DataError naming the missing step and the keys there are."""
    if key not in row:
        raise _no_column(origin, key, what, f"row has {sorted(row)}")
    value = row[key]
    for k in dict_keys or []:
        if not isinstance(value, dict) or k not in value:
            raise _no_dict_key(origin, key, dict_keys, k, what, sorted(value) if isinstance(value, dict) else
                               type(value).__name__)
        value = value[k]
    return value


def _no_column(origin: str, column: str, what: str, have: str) -> DataError:
    """The column of `what` ("prompt", "response", "messages": `data.<what>_key`) is missing; `have` says what
    there is."""
    fix = {"prompt": "set data.prompt_key to the column that holds it, or data.messages_key for conversations",
           "messages": "set data.messages_key to the column holding the conversation"}.get(
        what, f"set data.{what}_key to the column that holds it")
    return DataError(f"{origin}: no '{column}' column for the {what} ({have}). Fix: {fix}.")


def _no_dict_key(origin: str, key: str, dict_keys: list[str], k: str, what: str, have) -> DataError:
    return DataError(f"{origin}: {_where(key, dict_keys)}: no '{k}' in {have}. Fix: set data.{what}_dict_keys "
                     "to the path of the text inside the column.")


def check_columns(cols: Columns, d, key: str) -> None:
    """The columns a row of `d` (the SFT `data` config) needs, checked against what a file holds
    (`lathe.data.files.peek`) before its rows are read; errors as the row checks', naming `key` and the columns."""
    origin, have = f"{cols.src} ({key})", f"{cols.have} {sorted(cols.names)}"
    if d.multiturn.enable or (d.prompt_key not in cols.names and d.messages_key in cols.names):
        if d.messages_key not in cols.names:
            raise _no_column(origin, d.messages_key, "messages", have)
        return
    for what, column, dict_keys in (("prompt", d.prompt_key, d.prompt_dict_keys),
                                    ("response", d.response_key, d.response_dict_keys)):
        if column not in cols.names:
            raise _no_column(origin, column, what, have)
        fields = cols.names[column]
        if dict_keys and (fields is None or dict_keys[0] not in fields):
            raise _no_dict_key(origin, column, dict_keys, dict_keys[0], what,
                               "a column that is not a struct" if fields is None else sorted(fields))


def _messages(value: Any, origin: str, key: str, *, conversation: bool = False) -> list[dict]:
    """A list of {role, content} messages (other fields, e.g. tool_calls, kept)."""
    if hasattr(value, "tolist"):               # a numpy array from pandas-written parquet
        value = value.tolist()
    fix = f'make {key} a list like [{{"role": "user", "content": "..."}}, {{"role": "assistant", ...}}]'
    if not isinstance(value, list) or not value:
        raise DataError(f"{origin}: {key}: expected a non-empty list of messages, got {str(value)[:80]!r}. Fix: {fix}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{origin}: {key}[{j}]: expected {{role: str, content: str}}, got {str(m)[:120]}. "
                            f"Fix: {fix}")
        out.append({k: v for k, v in m.items() if v is not None})
    if conversation and not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{origin}: {key} has no assistant turn, so there is nothing to train on. Fix: drop the row "
                        "or add the assistant's answer.")
    return out
