"""Image prompts in the engine (Qwen2.5-VL / Qwen3-VL / Qwen3.5, `lathe.models.vl`): encode once, splice, position
in 3D.

A prompt with images arrives as its token ids (each image's placeholder tokens already expanded, as the processor
and `lathe.data.multimodal` make them) plus `{"pixel_values", "image_grid_thw"}`. `prepare_prompt` runs the vision
tower once for the prompt's images and keeps, in a `MultiModalPrompt` that the prompt's `n` samples share:
- the image embeddings (and Qwen3-VL's deepstack features), one row per placeholder token;
- the prompt's 3D rotary positions (3, P) and its `rope_delta`: token i >= P (everything generated, all text) sits
  at `i + rope_delta` on all three axes;
- `image_rows`: for each prompt token, its embedding row (-1 for text);
- `salt`: a digest of the images' pixels and grids. The prefix cache mixes it into the prompt's first block key
  (`BlockManager`), so two prompts with the same tokens but other images never share KV, while the `n` samples of
  one prompt (and a preempted sample's recompute) do.

The embeddings belong to the vision tower's weights. When the engine loads new weights while prompts wait (a weight
sync of fully-asynchronous training: queued requests, responses interrupted by partial rollout, an agent's
trajectory between two turns), it drops them (`drop_embeddings`: every prompt's the engine prepared and that is still
held anywhere); the prompt's next prefill encodes its images again with the new tower (`ensure_embeddings`).
The positions, image rows and salt depend on the tokens and pixels only, and stay.

`StepInputs` gathers what a prefill or decode step's forward needs beyond the token ids: 3D positions, and the
image rows to splice at the placeholders of the tokens it computes (a chunk of a long prompt gets its own slice).
`hidden_states` runs the decoder for text and VL models alike (a text decoder in the engine's forms:
`decode_forms.text_hidden`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from lathe.engine.decode_forms import text_hidden
from lathe.models.vl import is_vl


def rope_delta(seq) -> int:
    """How far a generated token's rotary position is from its index (an image prompt's `rope_delta`; 0 for text)."""
    return 0 if seq.mm is None else seq.mm.delta


def text_config(model):
    """The decoder's `LatheConfig` (a VL model's language model's)."""
    return model.config.text if is_vl(model) else model.config


@dataclass(eq=False)
class MultiModalPrompt:
    pixel_values: torch.Tensor           # the prompt's images as given (patches, D): encoded again after new weights
    grid: torch.Tensor                   # (images, 3) int64 image_grid_thw
    positions: torch.Tensor              # (3, P) int64 on the CPU: the prompt's rotary positions
    delta: int                           # token i >= P sits at i + delta on every axis
    image_rows: np.ndarray               # (P,) int64: embedding row of each prompt token, -1 for text
    salt: int                            # digest of the images: keys the prompt's prefix-cache blocks
    embeds: torch.Tensor | None = None   # (N, H) image embeddings, on the model's device; None: to encode
    deepstack: list[torch.Tensor] = field(default_factory=list)   # Qwen3-VL: one (N, H) per early layer


@torch.inference_mode()
def ensure_embeddings(model, mm: MultiModalPrompt) -> None:
    """Encode `mm`'s images with `model`'s vision tower, unless they are encoded already (since the last
    `drop_embeddings`)."""
    if mm.embeds is not None:
        return
    device = model.get_input_embeddings().weight.device
    out = model.embed_images(mm.pixel_values.to(device), mm.grid.to(device))
    mm.embeds, mm.deepstack = out.embeds, list(out.deepstack)


def drop_embeddings(prompts) -> int:
    """Forget the image embeddings of `prompts` (`MultiModalPrompt`s: new vision weights came); returns how many."""
    dropped = 0
    for mm in list(prompts):            # (a copy: `prompts` may be a WeakSet)
        if mm.embeds is not None:
            mm.embeds, mm.deepstack = None, []
            dropped += 1
    return dropped


def _digest(pixel_values: torch.Tensor, grid: torch.Tensor) -> int:
    h = hashlib.sha256()
    h.update(grid.to(torch.int64).cpu().contiguous().numpy().tobytes())
    h.update(pixel_values.detach().float().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


@torch.inference_mode()
def prepare_prompt(model, prompt: list[int], inputs: dict | None, where: str) -> MultiModalPrompt | None:
    """The shared multimodal state of one prompt, or None for a text prompt (no images). `where` names the prompt
    in errors."""
    from lathe.models.vl.rope import sequence_positions
    pixels = None if inputs is None else inputs.get("pixel_values")
    if pixels is None or len(pixels) == 0:
        if inputs is not None and inputs.get("image_grid_thw") is not None and len(inputs["image_grid_thw"]):
            raise ValueError(f"{where}: image_grid_thw is given without pixel_values")
        return None
    unknown = sorted(set(inputs) - {"pixel_values", "image_grid_thw"})
    if unknown:
        raise ValueError(f"{where}: multi_modal_inputs keys {unknown} are not supported (images only: pixel_values, "
                         "image_grid_thw; videos are not implemented)")
    grid = torch.as_tensor(inputs["image_grid_thw"], dtype=torch.int64)
    pixels = torch.as_tensor(pixels)
    cfg = model.config
    ids = torch.tensor(prompt, dtype=torch.int64)
    try:
        positions, delta, used = sequence_positions(ids, grid.tolist(), image_token_id=cfg.image_token_id,
                                                    video_token_id=cfg.video_token_id,
                                                    spatial_merge_size=cfg.spatial_merge_size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if used != len(grid):
        raise ValueError(f"{where}: image_grid_thw lists {len(grid)} image(s), the prompt holds placeholders for "
                         f"{used}; expand each image's pad tokens as the processor does")
    mask = (ids == cfg.image_token_id).numpy()
    rows = np.full(len(prompt), -1, dtype=np.int64)
    rows[mask] = np.arange(int(mask.sum()))
    mm = MultiModalPrompt(pixels, grid, positions.cpu(), int(delta), rows, _digest(pixels, grid))
    ensure_embeddings(model, mm)
    if int(mask.sum()) != mm.embeds.shape[0]:
        raise ValueError(f"{where}: {int(mask.sum())} image placeholder tokens for {mm.embeds.shape[0]} image "
                         "embeddings")
    return mm


def check_continuation(model, mm: MultiModalPrompt, prompt: list[int], where: str) -> MultiModalPrompt:
    """`mm`, prepared for an earlier prompt, as the image state of `prompt`, which continues that prompt (a later
    turn of a multi-turn conversation: the first prompt, then turns and tool answers). The earlier prompt's tokens
    keep their 3D positions and image rows; every token after them is text at `index + rope_delta`, as generated
    tokens are (an image placeholder among them too), and the prefix cache keys the blocks by the same salt."""
    p = len(mm.image_rows)
    head = np.asarray(prompt[:p], dtype=np.int64)
    if len(prompt) < p or not np.array_equal(head == model.config.image_token_id, mm.image_rows >= 0):
        raise ValueError(f"{where}: its prepared images belong to a prompt of {p} tokens whose image placeholders "
                         "this prompt does not start with; prepare the images of this prompt instead "
                         "(LatheEngine.prepare_images)")
    return mm


def token_positions(mm: MultiModalPrompt | None, start: int, end: int) -> torch.Tensor:
    """(3, end - start) rotary positions of tokens start..end-1 of a sequence with this prompt state."""
    if mm is None:
        return torch.arange(start, end).expand(3, -1)
    p = mm.positions.shape[1]
    head = mm.positions[:, start:min(end, p)]
    tail = torch.arange(max(start, p), max(end, p)) + mm.delta
    return torch.cat([head, tail.expand(3, -1)], dim=1)


class StepInputs:
    """A step's 3D positions and the image rows its tokens take (VL models only).

    Built by `add(seq_mm, start, end)` per sequence in the order its tokens are laid out; `visual` then holds the
    token mask and the spliced rows (embeddings, deepstack) on `device`."""

    def __init__(self):
        self.positions: list[torch.Tensor] = []
        self.mask: list[np.ndarray] = []
        self.rows: list[tuple[MultiModalPrompt, np.ndarray]] = []

    def add(self, mm: MultiModalPrompt | None, start: int, end: int) -> None:
        self.positions.append(token_positions(mm, start, end))
        if mm is None or start >= len(mm.image_rows):
            self.mask.append(np.zeros(end - start, dtype=bool))
            return
        rows = np.full(end - start, -1, dtype=np.int64)
        stop = min(end, len(mm.image_rows))
        rows[:stop - start] = mm.image_rows[start:stop]
        self.mask.append(rows >= 0)
        if (rows >= 0).any():
            if mm.embeds is None:
                raise RuntimeError("engine: a prefill met an image prompt whose embeddings were dropped at a weight "
                                   "load and not encoded again; this is a bug (see `ensure_embeddings`)")
            self.rows.append((mm, rows[rows >= 0]))

    def build(self, device: torch.device):
        """(positions (3, T), visual mask (T,) or None, embeddings (N, H) or None, deepstack list)."""
        positions = torch.cat(self.positions, dim=1).to(device)
        if not self.rows:
            return positions, None, None, []
        mask = torch.from_numpy(np.concatenate(self.mask)).to(device)
        embeds = torch.cat([mm.embeds[torch.from_numpy(r).to(mm.embeds.device)] for mm, r in self.rows])
        layers = len(self.rows[0][0].deepstack)
        deep = [torch.cat([mm.deepstack[k][torch.from_numpy(r).to(mm.embeds.device)] for mm, r in self.rows])
                for k in range(layers)]
        return positions, mask, embeds, deep


def hidden_states(model, ids: torch.Tensor, positions: torch.Tensor, attn, visual=None) -> torch.Tensor:
    """Final hidden states of `ids` (T,) through the decoder: a text model at `positions` (T,); a VL model at 3D
    `positions` (3, T) (or (T,), the same on every axis), with `visual` = (mask (T,), embeddings, deepstack) spliced
    at the image placeholders."""
    recorder = getattr(model, "routing_recorder", None)     # routing replay: the step's KV slots (`routing.py`)
    if recorder is not None:
        recorder.attn = attn
    if not is_vl(model):
        return text_hidden(model.model, ids, positions, attn)
    from lathe.models.vl.vision import merge_image_embeddings
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    embeds = model.get_input_embeddings()(ids)
    mask, deep = None, []
    if visual is not None and visual[0] is not None:
        mask, rows, deep = visual
        embeds = merge_image_embeddings(embeds, rows, mask)
    return model.model.language_model(embeds, positions, attn, mask, deep)
