"""verl's `data.custom_cls`: a user's dataset class (`path`: its Python file, `name`: the class) whose items become
lathe's prompt rows.

verl builds it as its `create_rl_dataset` does,

    cls(data_files=data.train_files, tokenizer=tokenizer, processor=processor, config=data, max_samples=N)

(`max_samples` only when the constructor takes it; lathe then keeps N of the items itself) and reads each item as
verl's `RLHFDataset.__getitem__` returns it::

    {"raw_prompt": [{"role": "user", "content": "..."}],   # the chat messages (or under data.prompt_key)
     "data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}, "extra_info": {...}, "ability": "math"}

`config` is the `data` group as a dict whose keys also read as attributes (`config.get("prompt_key")`,
`config.max_prompt_length`), as on the OmegaConf node verl passes; `processor` is the vision-language policy's, or
None. lathe reads every item once at start-up and hands them to `RLDataset` as the rows of a data file: the same
checks (an item without what lathe needs fails naming the item and the key), chat template, length filter and
truncation. Token ids the class made itself (`input_ids`, `raw_prompt_ids`, ...) are not read: lathe renders the
messages with the policy's chat template, as verl's agent loop renders `raw_prompt`. Images: verl's content lists
(`{"type": "image", "image": ...}` among `{"type": "text", "text": ...}`) become `<image>` placeholders and the row's
images, as do `multi_modal_data["image"]` and a `data.image_key` field. A class that subclasses verl's RLHFDataset
imports verl, which lathe does not bring: that import fails naming the module, and the fix is to make the class
standalone (a `torch.utils.data.Dataset` with `__len__` and `__getitem__`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from lathe.data.errors import DataError
from lathe.data.multimodal import IMAGE_PLACEHOLDER

KEY = "data.custom_cls"
TOKEN_FIELDS = ("input_ids", "attention_mask", "position_ids", "raw_prompt_ids")   # the class's own tokens: unread


class ConfigView(dict):
    """A config group as verl's custom classes read it: `config.get(key, default)`, `config[key]`, `config.key`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"data config has no key {name!r}") from None

    @classmethod
    def of(cls, value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            return cls({k: cls.of(v) for k, v in value.items()})
        return [cls.of(v) for v in value] if isinstance(value, list) else value


def load_dataset_class(path: str, name: str | None) -> type:
    """The class `name` of the Python file `path` (imported under a name of its own); a DataError naming the key, the
    file and the fix when the file is missing or fails to import, or the class is not there or not a dataset."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise DataError(f"{KEY}.path={path!r}: no such file ({full}). Fix: point it at the Python file that defines "
                        f"the dataset class (a relative path counts from the directory lathe runs in).")
    if not name:
        raise DataError(f"{KEY}.path={path!r} is set but {KEY}.name is not. Fix: set {KEY}.name=<the class>.")
    module = _import_once(full, path)
    module_name = module.__name__
    cls = getattr(module, name, None)
    if not inspect.isclass(cls):
        classes = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module_name)
        close = difflib.get_close_matches(name, classes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        what = "no class" if cls is None else f"{type(cls).__name__} {name!r}, not a class"
        raise DataError(f"{KEY}.name={name!r}: {path} has {what} {name!r} (classes defined there: "
                        f"{classes or 'none'}).{hint} Fix: set {KEY}.name to the dataset class.")
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(cls, m)]
    if missing:
        raise DataError(f"{KEY}.name={name!r}: the class has no {' or '.join(missing)}, so lathe cannot read its "
                        "items. Fix: make it a map-style dataset (torch.utils.data.Dataset with __len__ and "
                        "__getitem__), as verl requires.")
    return cls


def custom_source(path: str, name: str | None, files, tokenizer, processor, data_cfg,
                  max_samples: int) -> tuple[str, Iterator[tuple[str, dict]]]:
    """(what the rows are called in errors, the rows): the items of `name` from `path` built over `files` (one split's
    data files), for `RLDataset(rows=...)`."""
    dataset = build_dataset(load_dataset_class(path, name), files, tokenizer, processor, data_cfg, max_samples)
    src = f"{KEY} {name} ({path})"
    return src, custom_rows(dataset, src, data_cfg.prompt_key, data_cfg.image_key)


def _import_once(full: str, path: str):
    """The module of file `full`, imported once per content of the file (preflight and the run share it)."""
    with open(full, "rb") as f:
        digest = hashlib.sha1(full.encode() + b"\0" + f.read()).hexdigest()[:12]
    module_name = f"lathe_custom_dataset_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # any error of the user's file: name it and the file
        sys.modules.pop(module_name, None)
        fix = (f"install {e.name}, or make the class standalone (a torch.utils.data.Dataset: lathe does not bring "
               "verl, so a subclass of verl's RLHFDataset cannot import)" if isinstance(e, ModuleNotFoundError)
               else f"fix the file (run `python {path}` to see the whole error)")
        raise DataError(f"{KEY}.path={path!r}: importing the file failed with {type(e).__name__}: {e}. "
                        f"Fix: {fix}.") from e
    return module


def build_dataset(cls: type, files, tokenizer, processor, data_cfg, max_samples: int) -> Any:
    """`cls` called with verl's arguments (`max_samples` only when it takes it: RLDataset keeps that many of the
    items either way)."""
    kwargs = dict(data_files=files if isinstance(files, list) else [files], tokenizer=tokenizer,
                  processor=processor, config=ConfigView.of(data_cfg))
    params = inspect.signature(cls).parameters
    takes_max = "max_samples" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if takes_max:
        kwargs["max_samples"] = max_samples
    try:
        return cls(**kwargs)
    except TypeError as e:
        if "argument" not in str(e):
            raise
        raise DataError(f"{KEY}.name={cls.__name__}: the class cannot be built as verl builds it, "
                        f"{cls.__name__}(data_files=..., tokenizer=..., processor=..., config=...[, max_samples=...]) "
                        f"({e}). Fix: give its __init__ those parameters.") from e


def custom_rows(dataset, src: str, prompt_key: str, image_key: str) -> Iterator[tuple[str, dict]]:
    """(where, row) for each item of `dataset` (as `read_data_file` yields a file's rows): the item's fields in
    verl's row schema, its messages under `prompt_key` with `<image>` placeholders and its images under
    `image_key`."""
    for i in range(len(dataset)):
        item, where = dataset[i], f"item {i}"
        if not isinstance(item, Mapping):
            raise DataError(f"{src} {where}: expected a dict (verl's RLHFDataset item), got {type(item).__name__}. "
                            "Fix: return a dict with raw_prompt, data_source, reward_model and extra_info.")
        row = {k: v for k, v in item.items() if k not in TOKEN_FIELDS}
        messages = row.pop("raw_prompt", None)
        if messages is None:
            messages = row.get(prompt_key)
        if messages is None:
            raise DataError(f"{src} {where}: field 'raw_prompt': missing (the item has keys {sorted(item)}); lathe "
                            "renders each prompt from its chat messages. Fix: return the messages as "
                            f"item['raw_prompt'] (or under data.prompt_key={prompt_key!r}), a list like "
                            '[{"role": "user", "content": "..."}].')
        images = _images_of(row, image_key)
        row[prompt_key] = _placeholders(messages, images, f"{src} {where}")
        if images:
            row[image_key] = images
        yield where, row


def _images_of(row: dict, image_key: str) -> list:
    images = row.pop(image_key, None)
    mm = row.pop("multi_modal_data", None)
    if not images and isinstance(mm, Mapping):
        images = mm.get("image")
    return list(images) if images is not None else []


def _placeholders(messages: Any, images: list, origin: str) -> Any:
    """`messages` with verl's content lists made strings with `<image>` placeholders (their images appended to
    `images`); other messages (RLDataset checks them) as they are."""
    if not isinstance(messages, list):
        return messages
    out = []
    for j, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            msg = {**msg, "content": _content_text(content, images, f"{origin}: field 'raw_prompt[{j}].content'")}
        out.append(msg)
    return out


def _content_text(parts: list, images: list, where: str) -> str:
    text = []
    for part in parts:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            text.append(part.get("text", ""))
        elif kind == "image":
            text.append(IMAGE_PLACEHOLDER)
            image = part.get("image", {k: v for k, v in part.items() if k != "type"})
            images.append(image)
        else:
            raise DataError(f"{where}: a content part of type {kind!r} ({str(part)[:80]}); lathe takes text and "
                            "images. Fix: give text as {'type': 'text', 'text': ...} and images as "
                            "{'type': 'image', 'image': ...} (videos and audio are not implemented).")
    return "".join(text)
