"""Image prompts in verl's multimodal schema: `<image>` placeholders, an `images` column, Qwen-VL pixel inputs.

A multimodal row (verl's `examples/data_preprocess/geo3k.py` writes them) is a text row plus::

    "images": [{"bytes": b"\\x89PNG...", "path": None}, ...]     # data.image_key; or path strings, or raw bytes
    "prompt": [{"role": "user", "content": "<image>Find x. ..."}] # one `<image>` per image, in order

`encode_multimodal_prompt` turns one such row into what a Qwen2-VL / Qwen2.5-VL style model needs:

* the user text split at `<image>` into chat-template content items (`{"type": "image"}`, `{"type": "text"}`),
  rendered with the processor's (or tokenizer's) chat template, which writes `<|vision_start|><|image_pad|>
  <|vision_end|>` for each image;
* each image decoded, converted to RGB and resized as verl's `process_image` (qwen-vl-utils' `fetch_image`) does:
  sides rounded to multiples of `patch_size * merge_size`, area kept within [min_pixels, max_pixels];
* the image processor's `pixel_values` (num_patches, channels * temporal_patch_size * patch_size**2) and
  `image_grid_thw` (num_images, 3) = (t, h, w) patches per image;
* each `<|image_pad|>` expanded to `t * h * w // merge_size**2` copies, as the HF Qwen-VL processors do. lathe does
  this expansion itself (from the tokenizer and the image processor alone), because `Qwen2_5_VLProcessor` cannot
  be built without torchvision (its video processor); the result is the same token sequence.

The prompt length (data.max_prompt_length) is counted on these expanded ids, as verl counts it.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lathe.data.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", IMAGE_TOKEN, "<|vision_end|>")
MAX_ASPECT_RATIO = 200
_FIX_IMAGE = ("store each image as {'bytes': <PNG/JPEG bytes>, 'path': ...} (what HF datasets writes), a path to an "
              "existing image file, or raw image bytes")


class MultiModalPrompt(NamedTuple):
    """One encoded multimodal prompt.

    prompt_ids: chat-templated token ids with every `<|image_pad|>` expanded (len = the counted prompt length).
    multi_modal_inputs: {"pixel_values": float tensor (num_patches, C*T*P*P), "image_grid_thw": long (n_images, 3)}.
    images: the decoded, resized RGB PIL images (verl's multi_modal_data["image"]).
    """

    prompt_ids: list[int]
    multi_modal_inputs: dict[str, Any]
    images: list[Any]


@dataclass
class VisionProcessor:
    """A tokenizer plus a Qwen2-VL image processor: what lathe needs of a HF VL processor, built without torchvision.

    `tokenizer` must know `image_token` and render content lists with its chat template (or pass `chat_template`).
    """

    tokenizer: Any
    image_processor: Any
    chat_template: str | None = None
    image_token: str = IMAGE_TOKEN

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        """The tokenizer's chat template (or this processor's `chat_template`) over `messages`."""
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def load_processor(path: str):
    """The VL processor of checkpoint directory `path`: `AutoProcessor` (slow image processor) where it builds one
    with a tokenizer and an image processor.

    Two cases build lathe's `VisionProcessor` (`AutoTokenizer` + `AutoImageProcessor(use_fast=False)`; the same
    prompt ids and pixel inputs) instead: `AutoProcessor` gives a tokenizer alone (the directory has no processor
    config), or the processor class needs a library that is not installed (Qwen2.5-VL's video processor needs
    torchvision, and lathe reads no video), which a warning says. Any other failure, or a directory without an image
    processor, is a DataError naming `path` and the underlying error.
    """
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    try:
        processor = AutoProcessor.from_pretrained(path, use_fast=False)
    except ImportError as err:
        missing = str(err).strip().splitlines()[0]
        warnings.warn(f"{path}: transformers' processor cannot be built here ({missing}); lathe builds its own from "
                      f"the tokenizer and the image processor (images only; the same prompt ids).", stacklevel=2)
    except Exception as err:
        raise DataError(f"{path}: the processor could not be loaded: {_cause(err)}. Fix: point "
                        f"actor_rollout_ref.model.tokenizer_path (or model.path) at the vision-language checkpoint's "
                        f"directory (its tokenizer files and preprocessor_config.json).") from err
    else:
        if getattr(processor, "tokenizer", None) is not None and getattr(processor, "image_processor", None) is not None:
            return processor
    try:
        image_processor = AutoImageProcessor.from_pretrained(path, use_fast=False)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise DataError(f"{path}: no image processor and tokenizer could be loaded, so it is not a vision-language "
                        f"checkpoint lathe can read: {_cause(err)}. Fix: point "
                        f"actor_rollout_ref.model.tokenizer_path (or model.path) at a directory with the tokenizer "
                        f"files and preprocessor_config.json of a Qwen2-VL style model.") from err
    return VisionProcessor(tokenizer, image_processor, image_token=_image_token(path, tokenizer))


def _image_token(path: str, tokenizer) -> str:
    """The image placeholder token of the checkpoint at `path`: the tokenizer's own `image_token`, else the token of
    config.json's `image_token_id` (GLM-4.1V's `<|image|>`), else Qwen-VL's `<|image_pad|>`."""
    own = getattr(tokenizer, "image_token", None)
    if isinstance(own, str) and own:
        return own
    file = Path(path) / "config.json"
    try:
        token_id = json.loads(file.read_text()).get("image_token_id") if file.is_file() else None
    except (OSError, ValueError):
        token_id = None
    token = tokenizer.convert_ids_to_tokens(int(token_id)) if isinstance(token_id, int) else None
    return token if isinstance(token, str) and token != tokenizer.unk_token else IMAGE_TOKEN


def _cause(err: Exception) -> str:
    """`Type: message` of an error, on one line, without a trailing period."""
    return f"{type(err).__name__}: {' '.join(str(err).split()).rstrip('.')}"


def _parts(processor) -> tuple[Any, Any, str]:
    tokenizer = getattr(processor, "tokenizer", None)
    image_processor = getattr(processor, "image_processor", None)
    if tokenizer is None or image_processor is None:
        raise DataError(f"{type(processor).__name__} is not a vision-language processor (needs .tokenizer and "
                        ".image_processor). Fix: pass lathe.data.multimodal.load_processor(<Qwen2.5-VL dir>).")
    return tokenizer, image_processor, getattr(processor, "image_token", None) or IMAGE_TOKEN


# --------------------------------------------------------------------------- images


def decode_image(image: Any, origin: str, base_dir: str | None = None):
    """One image of a row as an RGB PIL image.

    `image`: {"bytes": ..., "path": ...} (bytes win; else the path), a path string, raw bytes, or a PIL image.
    Relative paths are tried as given, then under `base_dir` (the data file's folder). Raises DataError naming
    `origin` ("file row i, images[j]") and the fix when the image is missing or does not decode.
    """
    from PIL import Image
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    data, path = None, None
    if isinstance(image, dict):
        data, path = image.get("bytes"), image.get("path")
        if data is None and not path:
            raise DataError(f"{origin}: image dict has neither 'bytes' nor 'path' (keys {sorted(image)}). "
                            f"Fix: {_FIX_IMAGE}.")
    elif isinstance(image, (bytes, bytearray)):
        data = image
    elif isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
    else:
        raise DataError(f"{origin}: unsupported image value of type {type(image).__name__}. Fix: {_FIX_IMAGE}.")
    if data is None:
        full = _find(path, base_dir)
        if full is None:
            raise DataError(f"{origin}: image file not found: {path!r}"
                            + (f" (also tried under {base_dir})" if base_dir else "")
                            + ". Fix: correct the path, or embed the image bytes in the data file.")
        with open(full, "rb") as f:
            data = f.read()
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError ...
        raise DataError(f"{origin}: image does not decode ({type(e).__name__}: {e}). "
                        "Fix: re-encode it as PNG or JPEG, or drop the row.") from None


def _find(path: str, base_dir: str | None) -> str | None:
    full = os.path.expanduser(path)
    if os.path.isfile(full):
        return full
    if base_dir and not os.path.isabs(full) and os.path.isfile(os.path.join(base_dir, full)):
        return os.path.join(base_dir, full)
    return None


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, area scaled into [min_pixels, max_pixels], aspect kept.

    The resizing rule of qwen-vl-utils' `fetch_image` (used by verl's `process_image`). Raises ValueError for an
    aspect ratio above 200.
    """
    if max(height, width) / max(1, min(height, width)) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds {MAX_ASPECT_RATIO}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def process_image(image, factor: int, min_pixels: int | None = None, max_pixels: int | None = None):
    """An RGB PIL image resized by `smart_resize` (defaults: min 4 * factor**2, max 16384 * factor**2 pixels)."""
    from PIL import Image
    min_pixels = 4 * factor * factor if min_pixels is None else min_pixels
    max_pixels = 16384 * factor * factor if max_pixels is None else max_pixels
    h, w = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
    return image if (h, w) == (image.height, image.width) else image.resize((w, h), Image.Resampling.BICUBIC)


def load_images(raw: list, processor, origin: str, *, base_dir: str | None = None,
                min_pixels: int | None = None, max_pixels: int | None = None) -> list:
    """The row's images decoded and resized for `processor` (factor = patch_size * merge_size).

    A dict image's own "min_pixels"/"max_pixels" keys win over the arguments, as in verl.
    """
    _, image_processor, _ = _parts(processor)
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    out = []
    for j, image in enumerate(raw):
        where = f"{origin}, images[{j}]"
        lo, hi = min_pixels, max_pixels
        if isinstance(image, dict):
            lo, hi = image.get("min_pixels") or lo, image.get("max_pixels") or hi
        pil = decode_image(image, where, base_dir)
        try:
            out.append(process_image(pil, factor, lo, hi))
        except ValueError as e:
            raise DataError(f"{where}: {e}. Fix: crop or pad the image, or drop the row.") from None
    return out


def image_inputs(images: list, processor) -> dict[str, Any]:
    """{"pixel_values": (num_patches, C*T*P*P) float32, "image_grid_thw": (n_images, 3) int64} for PIL images."""
    import torch
    _, image_processor, _ = _parts(processor)
    out = image_processor(images=images, return_tensors="pt")
    return {"pixel_values": torch.as_tensor(out["pixel_values"]),
            "image_grid_thw": torch.as_tensor(out["image_grid_thw"]).long()}


# --------------------------------------------------------------------------- prompts


def count_placeholders(messages: list[dict]) -> int:
    """Number of `<image>` placeholders in the string contents of `messages`."""
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))


def image_messages(messages: list[dict], n_images: int, origin: str) -> list[dict]:
    """Copies of `messages` whose `<image>` placeholders become content lists for the processor's chat template.

    "a <image> b" -> [{"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": " b"}]; messages
    without a placeholder stay strings. Raises DataError when the placeholder count differs from `n_images`.
    """
    found = count_placeholders(messages)
    if found != n_images:
        raise DataError(f"{origin}: the prompt has {found} '{IMAGE_PLACEHOLDER}' placeholder(s) but the row has "
                        f"{n_images} image(s). Fix: put exactly one '{IMAGE_PLACEHOLDER}' in the prompt text where "
                        "each image goes, in the order of the images column.")
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            items: list[dict] = []
            for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
                if k:
                    items.append({"type": "image"})
                if text:
                    items.append({"type": "text", "text": text})
            content = items
        out.append({**m, "content": content})
    return out


def expand_image_tokens(ids: list[int], grid_thw, image_token_id: int, merge_size: int, origin: str) -> list[int]:
    """`ids` with the k-th `image_token_id` repeated `prod(grid_thw[k]) // merge_size**2` times."""
    counts = [int(t * h * w) // (merge_size * merge_size) for t, h, w in grid_thw.tolist()]
    out, k = [], 0
    for tok in ids:
        if tok != image_token_id:
            out.append(tok)
            continue
        if k >= len(counts):
            raise DataError(f"{origin}: the chat template wrote more image tokens than there are images. Fix: use a "
                            "Qwen-VL chat template that writes one <|image_pad|> per {'type': 'image'} item.")
        out.extend([image_token_id] * counts[k])
        k += 1
    if k != len(counts):
        raise DataError(f"{origin}: the chat template wrote {k} image token(s) for {len(counts)} image(s). Fix: use "
                        "the VL model's processor / chat template (it must render {'type': 'image'} content items).")
    return out


def render_prompt(messages: list[dict], processor, chat_template_kwargs: dict | None = None) -> str:
    """The chat-templated prompt text (add_generation_prompt=True) via the processor's or tokenizer's template."""
    render = getattr(processor, "apply_chat_template", None) or processor.tokenizer.apply_chat_template
    return render(messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {}))


def encode_multimodal_prompt(messages: list[dict], raw_images: list, processor, origin: str, *,
                             base_dir: str | None = None, min_pixels: int | None = None, max_pixels: int | None = None,
                             chat_template_kwargs: dict | None = None) -> MultiModalPrompt:
    """One row -> (expanded prompt ids, multi_modal_inputs, PIL images); see the module docstring.

    `messages`: the row's {role, content} list with `<image>` placeholders; `raw_images`: the row's images column;
    `origin`: "file row i" for error messages. Raises DataError for a placeholder/image count mismatch, a missing or
    undecodable image, or a chat template that does not render image items.
    """
    tokenizer, image_processor, image_token = _parts(processor)
    chat = image_messages(messages, len(raw_images), origin)
    images = load_images(raw_images, processor, origin, base_dir=base_dir, min_pixels=min_pixels, max_pixels=max_pixels)
    inputs = image_inputs(images, processor)
    try:
        text = render_prompt(chat, processor, chat_template_kwargs)
    except Exception as e:  # jinja raises TemplateError and friends
        raise DataError(f"{origin}: chat template failed on this prompt ({type(e).__name__}: {e})") from None
    image_token_id = tokenizer.convert_tokens_to_ids(image_token)
    if image_token_id is None or image_token_id == tokenizer.unk_token_id:
        raise DataError(f"the tokenizer has no {image_token!r} token. Fix: use the VL model's tokenizer/processor.")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = expand_image_tokens(ids, inputs["image_grid_thw"], image_token_id, int(image_processor.merge_size), origin)
    return MultiModalPrompt(ids, inputs, images)


def tiny_vl_processor(patch_size: int = 4, merge_size: int = 2, min_pixels: int = 64, max_pixels: int = 1024):
    """A small Qwen2-VL style `VisionProcessor` for tests: lathe's character tokenizer plus ChatML and vision special
    tokens, a Qwen-VL chat template, and a slow `Qwen2VLImageProcessor` with small patches and pixel limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lathe.data.builtin import builtin_tokenizer
    tok = builtin_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.chat_template = QWEN_VL_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2,
                                               min_pixels=min_pixels, max_pixels=max_pixels)
    return VisionProcessor(tok, image_processor)


QWEN_VL_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string %}{{- m['content'] }}{%- else %}{%- for c in m['content'] %}"
    "{%- if c['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif c['type'] == 'text' %}{{- c['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def multimodal_non_tensors(rows: list[dict]) -> dict[str, list]:
    """Per-sample `multi_modal_data` / `multi_modal_inputs` of dataset items, for a `Batch`'s non_tensors.

    Empty when no row has images; otherwise one entry per row (None for a text-only row), never padded into the
    token tensors. Use: `nt.update(multimodal_non_tensors(rows))` when building the prompt batch.
    """
    if not any("multi_modal_inputs" in r for r in rows):
        return {}
    return {k: [r.get(k) for r in rows] for k in ("multi_modal_data", "multi_modal_inputs")}


def concat_multi_modal_inputs(per_sample: list) -> dict[str, Any]:
    """Per-sample multi_modal_inputs (None for text rows) joined for one forward: pixel_values and image_grid_thw
    concatenated along dim 0 in sample order (how Qwen-VL models take a packed batch); {} when no sample has images."""
    import torch
    present = [m for m in per_sample if m]
    if not present:
        return {}
    return {k: torch.cat([m[k] for m in present]) for k in ("pixel_values", "image_grid_thw")}


def check_truncation(ids: list[int], cut: list[int], processor, origin: str, max_len: int) -> None:
    """Raise DataError when truncating a multimodal prompt from `ids` to `cut` removed any image token (the model
    would see fewer image tokens than pixel patches)."""
    tokenizer, _, image_token = _parts(processor)
    tid = tokenizer.convert_tokens_to_ids(image_token)
    if ids.count(tid) != cut.count(tid):
        raise DataError(f"{origin}: the prompt is {len(ids)} tokens with its image tokens expanded, longer than "
                        f"data.max_prompt_length={max_len}, and truncation would cut image tokens. Fix: raise "
                        "data.max_prompt_length, lower max_pixels, or set data.filter_overlong_prompts=True.")
