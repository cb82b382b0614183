"""RL prompt datasets in verl's parquet/jsonl schema, tokenized once at load.

A row (as verl's `examples/data_preprocess/*.py` write them)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # data.prompt_key
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

`RLDataset` validates every row up front (a bad row fails at start-up, naming file, row and
field, not minutes into training), renders the chat template with add_generation_prompt=True,
tokenizes, and drops or truncates prompts longer than data.max_prompt_length as verl's
RLHFDataset does (data.filter_overlong_prompts, data.truncation).

Rows with a non-empty images column (data.image_key, verl's multimodal schema) need a `processor`;
see lathe.data.multimodal for how they are encoded and which fields their items gain.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from lathe.data.errors import DataError
from lathe.data.files import Columns, data_files, read_data_file

TRUNCATION_MODES = ("error", "left", "right", "middle")
# Prompt ids by (tokenizer, template kwargs, messages), kept for the process: a second dataset over the same rows (a
# run's validation split, another run in the same process: a sweep, a notebook, the test suite's hundreds of short
# runs) skips the chat template and the tokenizer for them (~0.9 s for the built-in task's 4,352 prompts). Cleared when
# it would pass RENDER_MEMO_ROWS rows.
_RENDERED: dict[tuple, list[int]] = {}
RENDER_MEMO_ROWS = 1 << 18
RENDER_MEMO_MIN_ROWS = 256      # fewer text rows render faster than the memo's key (the vocabulary's hash) is made


def _tokenizer_key(tokenizer) -> tuple:
    """What a tokenizer's prompt ids depend on, as far as a memo can tell cheaply: its class, name, size, vocabulary
    (a hash of its token -> id pairs: ~0.1 s at 150k tokens) and chat template (not its merge rules)."""
    template = getattr(tokenizer, "chat_template", None)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return (type(tokenizer).__qualname__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer),
            hash(frozenset(vocab.items())), json.dumps(template, sort_keys=True) if template is not None else None)


def _messages_key(messages) -> str | None:
    """The messages as exact JSON, or None where they hold something JSON cannot state exactly (not memoised)."""
    try:
        return json.dumps(messages, sort_keys=True)
    except (TypeError, ValueError):
        return None


# The fix for each field a row must have (the row checks and `check_columns`).
PROMPT_FIX = "add the prompt messages, or set data.prompt_key to the column that holds them"
DATA_SOURCE_FIX = 'add "data_source" (e.g. "openai/gsm8k"); it selects the reward function'
GROUND_TRUTH_FIX = 'add "reward_model": {"style": "rule", "ground_truth": <answer>}'
REWARD_SOURCE = "reward_source"     # an item's data.reward_fn_key column, when that is not data_source


def reward_fn_key_fix(key: str) -> str:
    return (f"data.reward_fn_key={key!r} names the column whose value the reward function gets as data_source: add "
            "that column to the data, or set data.reward_fn_key to a column it has")


# --------------------------------------------------------------------------- row schema


def _fail(src: str, where: str, field: str, problem: str, fix: str) -> DataError:
    return DataError(f"{src} {where}: field '{field}': {problem}. Fix: {fix}")


def missing_field(src: str, where: str, field: str, have: str, names, fix: str) -> DataError:
    """`field` is not there: the error lists what is (`have`: "row has keys", "the file's columns")."""
    return _fail(src, where, field, f"missing ({have} {sorted(names)})", fix)


def _check_messages(prompt: Any, src: str, where: str, key: str) -> list[dict]:
    """The prompt as a list of {role, content} messages, or a DataError saying what is wrong."""
    fix = f'make {key} a list like [{{"role": "user", "content": "..."}}]'
    if not isinstance(prompt, list) or not prompt:
        got = "an empty list" if prompt == [] else f"{type(prompt).__name__} {str(prompt)[:60]!r}"
        raise _fail(src, where, key, f"expected a non-empty list of messages, got {got}", fix)
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise _fail(src, where, f"{key}[{j}]", f"expected a {{role, content}} dict, got {msg!r}"[:200], fix)
        if not isinstance(msg["role"], str) or not msg["role"]:
            raise _fail(src, where, f"{key}[{j}].role", f"expected a non-empty string, got {msg['role']!r}", fix)
        if not isinstance(msg["content"], str):
            raise _fail(
                src, where, f"{key}[{j}].content",
                f"expected a string, got {type(msg['content']).__name__}", "store message text as a string",
            )
        if not msg["content"].strip():
            raise _fail(src, where, f"{key}[{j}].content", "empty message", "drop the row or fill in the text")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _check_fields(row: dict, src: str, where: str) -> tuple[str, str, Any, dict]:
    """data_source, ability, ground_truth, extra_info of a row, checked against verl's schema."""
    ds = row.get("data_source")
    if not isinstance(ds, str) or not ds:
        raise _fail(src, where, "data_source", f"expected a non-empty string, got {ds!r}", DATA_SOURCE_FIX)
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise _fail(src, where, "reward_model.ground_truth", f"missing (reward_model={rm!r})"[:200], GROUND_TRUTH_FIX)
    ability = row.get("ability", "")
    if ability is None:
        ability = ""
    if not isinstance(ability, str):
        raise _fail(src, where, "ability", f"expected a string, got {type(ability).__name__}", 'e.g. "math"')
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise _fail(src, where, "extra_info", f"expected a dict, got {type(extra).__name__}",
                    "store extra_info as a JSON object / parquet struct")
    return ds, ability, rm["ground_truth"], extra


def reward_source(item: dict) -> Any:
    """What an item's reward function gets as data_source: its `data.reward_fn_key` column (`data_source` by
    default)."""
    return item.get(REWARD_SOURCE, item["data_source"])


def _reward_source(row: dict, key: str, src: str, where: str) -> Any:
    """The row's `data.reward_fn_key` column: what its reward function gets as data_source."""
    if key not in row:
        raise missing_field(src, where, key, "row has keys", row, reward_fn_key_fix(key))
    if row[key] is None:
        raise _fail(src, where, key, "null", reward_fn_key_fix(key))
    return row[key]


def check_columns(cols: Columns, prompt_key: str, key: str, reward_fn_key: str = "data_source") -> None:
    """The fields every row needs, checked against what a file holds (`lathe.data.files.peek`: a parquet schema, a
    first row) before its rows are read; the errors name the file, `key` (the config key that named the file), the
    columns there are and the fix, as the row checks do. `reward_fn_key`: the column the reward function's
    data_source comes from."""
    where = f"({key})"
    fields = ((prompt_key, PROMPT_FIX), ("data_source", DATA_SOURCE_FIX), ("reward_model", GROUND_TRUTH_FIX),
              (reward_fn_key, reward_fn_key_fix(reward_fn_key)))
    for field, fix in fields:
        if field not in cols.names:
            raise missing_field(cols.src, where, field, cols.have, cols.names, fix)
    fields = cols.names["reward_model"]
    if fields is not None and "ground_truth" not in fields:
        raise missing_field(cols.src, where, "reward_model.ground_truth", "reward_model has", fields, GROUND_TRUTH_FIX)


# --------------------------------------------------------------------------- tokens


def truncate_ids(ids: list[int], max_len: int, mode: str) -> list[int]:
    """Cut `ids` to `max_len` tokens: "left" keeps the end, "right" the start, "middle" both ends."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[len(ids) - max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        tail = max_len - head
        return ids[:head] + (ids[len(ids) - tail:] if tail else [])
    raise ValueError(f"data.truncation={mode!r}; use one of {TRUNCATION_MODES}")


def _require_chat_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise DataError(
        f"tokenizer {name!r} has no chat template, so prompts cannot be rendered. Fix: use an "
        "instruct/chat model's tokenizer, or set actor_rollout_ref.model.custom_chat_template "
        "(a Jinja template string), or use lathe.data.builtin.builtin_tokenizer()."
    )


class RLDataset:
    """Map-style prompt dataset: validated, chat-templated and tokenized at construction.

    `files` is one path or a list (parquet, jsonl, json; `~` expanded; concatenated in order),
    or "builtin:arithmetic". `split` picks the builtin split. Items are dicts with prompt_ids,
    raw_prompt (the messages), data_source, ability, ground_truth, extra_info and index (the
    row's position in the concatenated, unfiltered data); with a `reward_fn_key` other than
    data_source also reward_source, that column's value (what the reward function gets as
    data_source). `num_filtered` counts prompts dropped as longer than max_prompt_length when
    filter_overlong_prompts=True.

    Image rows (non-empty `image_key` column) need `processor` (a Qwen-VL processor, see
    lathe.data.multimodal); `min_pixels`/`max_pixels` bound the image resize. Their items also carry
    multi_modal_data {"image": [PIL]} and multi_modal_inputs {pixel_values, image_grid_thw}. `processor_error`:
    why a vision-language checkpoint's processor could not be loaded (text rows do not need it), said by the
    error of the first image row.
    """

    def __init__(self, files: str | list[str], tokenizer, *, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, filter_overlong_prompts: bool = False,
                 truncation: str = "error", apply_chat_template_kwargs: dict | None = None,
                 split: str = "train", processor=None, image_key: str = "images",
                 min_pixels: int | None = None, max_pixels: int | None = None, max_samples: int = -1,
                 shuffle: bool = False, seed: int | None = None,
                 rows: tuple[str, Iterable[tuple[str, dict]]] | None = None, reward_fn_key: str = "data_source",
                 video_key: str = "videos", processor_error: str | None = None):
        """`max_samples` > 0 keeps that many rows (verl's `data.train_max_samples` / `val_max_samples`): a random
        subset drawn with `seed` when `shuffle`, else the first ones; before long prompts are filtered. `rows`:
        (their name, (where, row) pairs) read instead of `files` (a custom dataset class's items:
        lathe.data.custom), checked and tokenized as a file's rows are."""
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r} is not supported; use one of {TRUNCATION_MODES}")
        if max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length={max_prompt_length}; it must be >= 1")
        _require_chat_template(tokenizer)
        self.files = data_files(files)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.split = split
        self.processor, self.processor_error = processor, processor_error
        self.image_key, self.video_key = image_key, video_key
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.max_samples, self.shuffle, self.seed = max_samples, shuffle, seed
        self.rows = rows
        self.reward_fn_key = reward_fn_key
        self.num_filtered = 0
        self.num_truncated = 0
        self._items: list[dict[str, Any]] = []
        self._load()

    # ---- loading

    def _load(self) -> None:
        records, origins = self._validated_records()
        keep = sample_rows(len(records), self.max_samples, shuffle=self.shuffle, seed=self.seed)
        if keep is not None:
            records, origins = [records[i] for i in keep], [origins[i] for i in keep]
        text_rows = [i for i, r in enumerate(records) if "_images" not in r]
        text_ids = self._text_ids([records[i]["raw_prompt"] for i in text_rows], [origins[i] for i in text_rows])
        all_ids: list = [None] * len(records)
        for i, ids in zip(text_rows, text_ids):
            all_ids[i] = ids
        for i, rec in enumerate(records):
            if all_ids[i] is None:
                all_ids[i] = self._encode_multimodal(rec, origins[i])
        for rec, ids, origin in zip(records, all_ids, origins):
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    raise self._overlong_error(origin, len(ids))
                ids = self._truncate(ids, rec, origin)
                self.num_truncated += 1
            rec["prompt_ids"] = list(ids)
            self._items.append(rec)

    def _text_ids(self, prompts: list[list[dict]], origins: list[str]) -> list[list[int]]:
        """Each text prompt's ids after the chat template: from `_RENDERED` where this tokenizer and these template
        kwargs rendered the same messages before, else rendered and tokenized now (and kept)."""
        try:
            context = None if len(prompts) < RENDER_MEMO_MIN_ROWS else (
                _tokenizer_key(self.tokenizer), json.dumps(self.apply_chat_template_kwargs, sort_keys=True))
        except (TypeError, ValueError):
            context = None
        keys = [None if context is None else _messages_key(m) for m in prompts]
        todo = [j for j, k in enumerate(keys) if k is None or (context, k) not in _RENDERED]
        texts = [self._render(prompts[j], origins[j]) for j in todo]
        fresh = dict(zip(todo, self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []))
        out = [fresh[j] if j in fresh else _RENDERED[context, k] for j, k in enumerate(keys)]
        if len(_RENDERED) + len(todo) > RENDER_MEMO_ROWS:
            _RENDERED.clear()
        for j, ids in fresh.items():
            if keys[j] is not None:
                _RENDERED[context, keys[j]] = ids
        return out

    def _truncate(self, ids: list[int], rec: dict, origin: str) -> list[int]:
        cut = truncate_ids(ids, self.max_prompt_length, self.truncation)
        if "_images" in rec:
            from lathe.data.multimodal import check_truncation
            check_truncation(ids, cut, self.processor, origin, self.max_prompt_length)
        return cut

    def _encode_multimodal(self, rec: dict, origin: str) -> list[int]:
        """Expanded prompt ids of an image row; the pixels are dropped here and recomputed by __getitem__."""
        from lathe.data.multimodal import encode_multimodal_prompt
        enc = encode_multimodal_prompt(rec["raw_prompt"], rec["_images"], self.processor, origin,
                                       base_dir=rec["_base_dir"], min_pixels=self.min_pixels,
                                       max_pixels=self.max_pixels, chat_template_kwargs=self.apply_chat_template_kwargs)
        rec["_origin"] = origin
        return enc.prompt_ids

    def _validated_records(self) -> tuple[list[dict], list[str]]:
        """All rows of all files, schema-checked, in file order; plus "file location" origins."""
        records, origins, n_string_prompts = [], [], 0
        sources = [self.rows] if self.rows is not None else [
            (os.path.expanduser(path), read_data_file(path, self.split)) for path in self.files]
        for src, rows in sources:
            for where, row in rows:
                if not isinstance(row, dict):
                    raise DataError(f"{src} {where}: expected a JSON object / parquet row, got {type(row).__name__}")
                if self.prompt_key not in row:
                    raise missing_field(src, where, self.prompt_key, "row has keys", row, PROMPT_FIX)
                prompt = row[self.prompt_key]
                if isinstance(prompt, str):
                    n_string_prompts += 1
                    prompt = [{"role": "user", "content": prompt}]
                messages = _check_messages(prompt, src, where, self.prompt_key)
                ds, ability, gt, extra = _check_fields(row, src, where)
                records.append({"raw_prompt": messages, "data_source": ds, "ability": ability,
                                "ground_truth": gt, "extra_info": extra, "index": len(records)})
                if self.reward_fn_key != "data_source":
                    records[-1][REWARD_SOURCE] = _reward_source(row, self.reward_fn_key, src, where)
                if row.get("agent_name") is not None:        # verl: the custom agent loop that runs the row
                    if not isinstance(row["agent_name"], str) or not row["agent_name"]:
                        raise _fail(src, where, "agent_name", f"expected a loop's name, got {row['agent_name']!r}",
                                    "give the name of an agent loop (rollout.agent.agent_loop_config_path's), or "
                                    "leave it null for rollout.agent.default_agent_loop")
                    records[-1]["agent_name"] = row["agent_name"]
                videos = row.get(self.video_key)
                if videos is not None and (not isinstance(videos, (list, tuple)) or len(videos)):
                    raise _fail(src, where, self.video_key, "the row has videos, and video prompts are not "
                                "implemented in lathe (its vision-language models take images)", "give a video as "
                                f"image frames in the '{self.image_key}' column, one <image> placeholder per frame, "
                                f"and drop the '{self.video_key}' column (or leave it empty)")
                images = row.get(self.image_key)
                if images is not None and (not isinstance(images, (list, tuple)) or len(images)):
                    records[-1].update(self._image_fields(images, src, where))
                origins.append(f"{src} {where}")
        if n_string_prompts:
            warnings.warn(
                f"{n_string_prompts} row(s) in {self.files} give '{self.prompt_key}' as a plain string; "
                "lathe treats each as one user message. verl requires a list of {role, content} "
                "messages: convert the data to run it under verl too.",
                stacklevel=3,
            )
        return records, origins

    def _image_fields(self, images: Any, src: str, where: str) -> dict:
        """Private fields of an image row: the raw images and the folder relative image paths start from."""
        if not isinstance(images, (list, tuple)):
            raise _fail(src, where, self.image_key, f"expected a list of images, got {type(images).__name__}",
                        "store one list of images per row (HF datasets' Sequence(Image()))")
        if self.processor is None and self.processor_error:
            raise _fail(src, where, self.image_key, f"the row has {len(images)} image(s) but the model's processor "
                        f"could not be loaded ({self.processor_error})", "see the processor's error")
        if self.processor is None:
            raise _fail(src, where, self.image_key, f"the row has {len(images)} image(s) but no vision processor "
                        "was given", "train a vision-language model (its processor encodes the images), or drop "
                        f"the '{self.image_key}' column for a text-only model")
        return {"_images": list(images), "_base_dir": os.path.dirname(os.path.abspath(src))}

    def _render(self, messages: list[dict], origin: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.apply_chat_template_kwargs
            )
        except Exception as e:  # jinja raises TemplateError and friends
            raise DataError(f"{origin}: chat template failed on this prompt ({type(e).__name__}: {e})") from None

    def _overlong_error(self, origin: str, length: int) -> DataError:
        return DataError(
            f"{origin}: prompt is {length} tokens after the chat template, longer than "
            f"data.max_prompt_length={self.max_prompt_length}. Fix: raise data.max_prompt_length "
            "(to at least this length), or set data.filter_overlong_prompts=True to drop such "
            "prompts, or set data.truncation=left|right|middle to cut them."
        )

    # ---- map-style access

    def __len__(self) -> int:
        return len(self._items)

    @property
    def has_images(self) -> bool:
        """Whether any row carries images (`image_key`)."""
        return any("_images" in item for item in self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self._items[i]
        if "_images" not in item:
            out = {**item, "prompt_ids": list(item["prompt_ids"])}
            if self.processor is not None:      # a VL run: every batch carries the columns (DAPO's rounds concatenate)
                out.update(multi_modal_data=None, multi_modal_inputs=None)
            return out
        return self._multimodal_item(item)

    def _multimodal_item(self, item: dict) -> dict[str, Any]:
        """An image row's item: decodes its images and runs the image processor now (pixels are not kept in memory)."""
        from lathe.data.multimodal import image_inputs, load_images
        images = load_images(item["_images"], self.processor, item["_origin"], base_dir=item["_base_dir"],
                             min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        inputs = image_inputs(images, self.processor)
        out = {k: v for k, v in item.items() if not k.startswith("_")}
        out["prompt_ids"] = list(item["prompt_ids"])
        out["multi_modal_data"] = {"image": images}
        out["multi_modal_inputs"] = inputs
        return out

    def __repr__(self) -> str:
        return (f"RLDataset(files={self.files}, rows={len(self)}, filtered={self.num_filtered}, "
                f"max_prompt_length={self.max_prompt_length})")


def sample_rows(total: int, max_samples: int, *, shuffle: bool, seed: int | None) -> list[int] | None:
    """The rows verl's `max_samples` keeps (None: all): `max_samples` of `total` drawn without replacement by
    `numpy.random.default_rng(seed)` when `shuffle`, else the first `max_samples`."""
    if max_samples <= 0 or max_samples >= total:
        return None
    if shuffle:
        rng = np.random.default_rng(*((seed,) if seed is not None else ()))
        return rng.choice(total, size=max_samples, replace=False).tolist()
    return list(range(max_samples))
