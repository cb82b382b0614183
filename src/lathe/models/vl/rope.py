"""Multimodal rotary positions (M-RoPE, Qwen2-VL paper, Wang et al., 2024) and the 3D position ids of a sequence.

Every token has three positions, (temporal, height, width). A text token has the same value on all three axes: its
index counted from the sequence start, where an image counts as `max(h, w) / merge` steps. The tokens of an image
of (t, h, w) patches form a (t, h/merge, w/merge) grid placed at the current text position p: token (i, j, k) sits
at (p + i, p + j, p + k), and the text after the image resumes at p + max(h, w) / merge.

Each rotary half-dimension (frequency) takes its angle from one axis:
- Qwen2.5-VL (blocks): the first `mrope_section[0]` frequencies from temporal, the next `[1]` from height, then
  `[2]` from width.
- Qwen3-VL (interleaved): frequency f takes height when f % 3 == 1 and f < 3 * section[1], width when f % 3 == 2
  and f < 3 * section[2], temporal otherwise.
The text positions (equal on all axes) give plain 1D RoPE, so a text-only sequence is rotated as by the text model.

`rope_deltas` (one per sequence) = (largest position + 1) - (real tokens): a decode step for the token at index n
(counting real tokens from 0) uses position n + rope_delta on all three axes.
"""

from __future__ import annotations

import torch

from lathe.models.config import RopeConfig
from lathe.models.rope import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """(cos, sin) of shape (..., head_dim) for positions (3, ...), the axes mixed per `mrope_section`."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, mrope_section: list[int],
                 interleaved: bool):
        super().__init__(rope, head_dim, max_position_embeddings)
        self.mrope_section, self.interleaved = list(mrope_section), interleaved

    def mix_axes(self, freqs: torch.Tensor) -> torch.Tensor:
        """(3, ..., head_dim / 2) per-axis angles -> (..., head_dim / 2), each frequency from its axis."""
        if self.interleaved:
            out = freqs[0].clone()
            for axis in (1, 2):
                pick = slice(axis, 3 * self.mrope_section[axis], 3)
                out[..., pick] = freqs[axis, ..., pick]
            return out
        chunks = freqs.split(self.mrope_section, dim=-1)
        return torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 0 or position_ids.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be (3, ...) (temporal, height, width), got "
                             f"{tuple(position_ids.shape)}; compute them with lathe.models.vl.mrope_positions")
        freqs = self.mix_axes(position_ids[..., None].float() * self._inv_freq(position_ids))
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def image_token_count(grid_thw, spatial_merge_size: int) -> int:
    """Placeholder tokens of one image of (t, h, w) patches: t * h * w / merge**2."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // spatial_merge_size ** 2


def sequence_positions(input_ids: torch.Tensor, image_grids: list, *, image_token_id: int, video_token_id: int,
                       spatial_merge_size: int) -> tuple[torch.Tensor, int, int]:
    """(positions (3, n), rope_delta, images used) of ONE sequence of real tokens `input_ids` (n,).

    `image_grids` are the (t, h, w) grids of the images still to place, in order; a run of image tokens takes as
    many of them as its length covers.
    """
    ids = input_ids.tolist()
    if video_token_id in ids:
        raise NotImplementedError(f"video placeholder tokens (video_token_id={video_token_id}) are not implemented "
                                  "by lathe's VL model; give videos as image frames or use the transformers fallback")
    parts: list[torch.Tensor] = []
    pos, i, used, n = 0, 0, 0, len(ids)
    while i < n:
        j = i
        if ids[i] != image_token_id:
            while j < n and ids[j] != image_token_id:
                j += 1
            parts.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        while j < n and ids[j] == image_token_id:
            j += 1
        run = j - i
        while run > 0:          # images placed back to back share one run of placeholders
            if used >= len(image_grids):
                raise ValueError(f"input_ids hold more image tokens (image_token_id={image_token_id}) than "
                                 f"image_grid_thw covers ({len(image_grids)} images); pass one grid per image")
            t, h, w = (int(x) for x in image_grids[used])
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            count = t * gh * gw
            if count > run:
                raise ValueError(f"an image of grid (t, h, w) = {(t, h, w)} needs {count} placeholder tokens but "
                                 f"its run in input_ids holds {run}; the prompt and image_grid_thw disagree")
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij"))
            parts.append(grid.reshape(3, -1) + pos)
            pos += max(h, w) // spatial_merge_size
            used, run = used + 1, run - count
        i = j
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - n) if n else 0
    return positions.to(input_ids.device), delta, used


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, *, image_token_id: int, video_token_id: int = -1,
                    spatial_merge_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids (3, B, L), rope_deltas (B, 1)) of a padded batch, as transformers' `get_rope_index`.

    `image_grid_thw` (images, 3) lists every image of the batch in order (row by row). Only real tokens
    (`attention_mask == 1`) are counted; padding gets position 0.
    """
    B, L = input_ids.shape
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    out = torch.zeros(3, B, L, dtype=torch.long, device=input_ids.device)
    deltas = []
    for b in range(B):
        real = attention_mask[b].bool() if attention_mask is not None else torch.ones(L, dtype=torch.bool,
                                                                                      device=input_ids.device)
        pos, delta, used = sequence_positions(input_ids[b][real], grids, image_token_id=image_token_id,
                                              video_token_id=video_token_id, spatial_merge_size=spatial_merge_size)
        grids = grids[used:]
        out[:, b, real] = pos
        deltas.append(delta)
    if grids:
        raise ValueError(f"image_grid_thw lists {len(grids)} more image(s) than input_ids hold placeholders for")
    return out, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def packed_mrope_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, image_grid_thw: torch.Tensor | None =
                           None, *, image_token_id: int, video_token_id: int = -1, spatial_merge_size: int = 2
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids (3, T), rope_deltas (S,)) of a packed stream: each sequence counted from 0 on its own."""
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    bounds = cu_seqlens.tolist()
    parts, deltas = [], []
    for start, end in zip(bounds[:-1], bounds[1:]):
        pos, delta, used = sequence_positions(input_ids[start:end], grids, image_token_id=image_token_id,
                                              video_token_id=video_token_id, spatial_merge_size=spatial_merge_size)
        grids = grids[used:]
        parts.append(pos)
        deltas.append(delta)
    if grids:
        raise ValueError(f"image_grid_thw lists {len(grids)} more image(s) than input_ids hold placeholders for")
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions.to(input_ids.device), torch.tensor(deltas, device=input_ids.device)
