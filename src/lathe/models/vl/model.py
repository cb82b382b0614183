"""Qwen2.5-VL, Qwen3-VL, Qwen3.5(-MoE), GLM-4.1V and GLM-4.5V: transformers' vision tower feeding lathe's decoder
layers with M-RoPE (Qwen3.5's: the hybrid gated-DeltaNet / gated-attention layers of `lathe.models.qwen3_5`;
GLM-4.1V's: GLM-4's, whose checkpoint layout `lathe.models.glm4` converts; GLM-4.5V's: GLM-4.5's MoE layers).

Module and parameter names are the checkpoints' (`model.visual.*`, `model.language_model.layers.N.*`,
`model.language_model.embed_tokens.weight`, `lm_head.weight`), so state dicts move with no renaming.

Entry points (as lathe's text model):
- `forward(input_ids, attention_mask, pixel_values=, image_grid_thw=)`: a padded (B, L) batch -> `.logits`
  (B, L, V); the 3D positions are computed from the tokens unless `position_ids` (3, B, L) is given.
- `hidden_packed(input_ids, position_ids, cu_seqlens, max_seqlen, pixel_values=, image_grid_thw=)`: T tokens of
  S sequences end to end with positions (3, T) -> hidden states (T, H); `forward_packed` also gives logits.
- `embed_images(pixel_values, image_grid_thw)` -> `ImageEmbeddings`: the vision call alone; both forwards also
  take `image_embeds=` (precomputed, e.g. once per image by a rollout engine) instead of pixels.
- `hidden_with(input_ids, position_ids, attn, ...)`: a sequence-parallel rank's slice of a packed stream (Ulysses).
Videos are not implemented and are refused.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lathe.models.attention import FLASH_BACKENDS, PackedAttention, PaddedAttention, select_packed_backend
from lathe.models.decoder import CausalLMOutput, DecoderLayer, RMSNorm, recomputes, set_checkpointing
from lathe.models.vl.config import VLConfig
from lathe.models.vl.io import save_vl_pretrained
from lathe.models.vl.rope import MRotaryEmbedding, mrope_positions
from lathe.models.vl.vision import ImageEmbeddings, build_vision_tower, embed_images, merge_image_embeddings


class LatheVLTextModel(nn.Module):
    """Embeddings, lathe's decoder layers and the final norm (HF's `model.language_model.` prefix), with M-RoPE
    and Qwen3-VL's deepstack: extra image features added to the image tokens after each of the first layers
    (Qwen3.5 has none)."""

    compile_backend: str | None = None

    def __init__(self, cfg: VLConfig):
        super().__init__()
        t = cfg.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        if t.linear_attention is not None:      # Qwen3.5: the hybrid layers, RoPE over part of each head
            from lathe.models.qwen3_5 import hybrid_parts
            self.layers, self.norm, _ = hybrid_parts(t)
        else:
            self.layers = nn.ModuleList(DecoderLayer(t, i) for i in range(t.num_hidden_layers))
            self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.rotary_emb = MRotaryEmbedding(t.rope, t.rotary_dim, t.max_position_embeddings, cfg.mrope_section,
                                           cfg.mrope_interleaved)
        self.gradient_checkpointing = False
        self.gradient_checkpointing_layers: int | None = None     # `lathe.models.decoder.recomputes`

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attn,
                visual_mask: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Final-norm hidden states (..., H) of `inputs_embeds` (..., H) at positions (3, ...); `deepstack[i]`
        (N, H) is added at the N tokens of `visual_mask` (...) after layer i."""
        x = inputs_embeds
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        deepstack = deepstack or []
        for i, layer in enumerate(self.layers):
            if recomputes(self, i):
                x = checkpoint(layer, x, cos, sin, attn, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn)
            if i < len(deepstack):
                x = torch.index_put(x, (visual_mask,), x[visual_mask] + deepstack[i].to(x.dtype))
        return self.norm(x)


class LatheVLModel(nn.Module):
    """HF's `model.`: the vision tower (`visual`) and the language model (`language_model`)."""

    def __init__(self, cfg: VLConfig, vision_attn_implementation: str = "sdpa"):
        super().__init__()
        self.visual = build_vision_tower(cfg, vision_attn_implementation)
        self.language_model = LatheVLTextModel(cfg)


class LatheVLForConditionalGeneration(nn.Module):
    """A Qwen2.5-VL / Qwen3-VL / Qwen3.5 model: `model.visual`, `model.language_model`, `lm_head` (tied when
    configured)."""

    attn_backend: str = "auto"      # packed attention: "auto" | "varlen" | "fa4" | "sdpa" (`set_attention`)
    padded_attention: str = "auto"  # padded batches: "auto" | "mask" | "unpad"

    def __init__(self, cfg: VLConfig, *, vision_attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = cfg
        self.model = LatheVLModel(cfg, vision_attn_implementation)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.tie_weights()

    # ---- HF-style switches and properties -------------------------------------------------------------------
    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.language_model.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.get_input_embeddings().weight.device

    def packed_backend(self) -> str:
        return select_packed_backend(self.attn_backend, self.device, self.dtype)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, *,
                                      layers: int | None = None) -> None:
        """Recompute the language model's decoder layers in backward: every layer, or with `layers` the first
        `layers` only (`lathe.models.decoder.recomputes`); the vision tower keeps transformers' own switch."""
        set_checkpointing(self.model.language_model, True, layers)

    def gradient_checkpointing_disable(self) -> None:
        set_checkpointing(self.model.language_model, False, None)

    def save_pretrained(self, path, *, max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                        state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write config.json and safetensors weights that transformers loads (see `save_vl_pretrained`)."""
        save_vl_pretrained(self, path, max_shard_size=max_shard_size, state=state_dict)

    # ---- the pieces a rollout engine calls on its own ---------------------------------------------------------
    def embed_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> ImageEmbeddings:
        """The vision tower alone: (patches, C*tp*p*p) pixels and (images, 3) grids -> ImageEmbeddings (N, H)."""
        return embed_images(self.model.visual, pixel_values, image_grid_thw)

    def image_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Where the image placeholders are; refuses video placeholders."""
        if bool((input_ids == self.config.video_token_id).any()):
            raise NotImplementedError(f"input_ids hold video tokens (video_token_id={self.config.video_token_id}); "
                                      "lathe's VL model implements images only: use the transformers fallback")
        return input_ids == self.config.image_token_id

    def mrope_positions(self, input_ids, image_grid_thw=None, attention_mask=None):
        """(position_ids (3, B, L), rope_deltas (B, 1)) of a padded batch, as transformers' `get_rope_index`."""
        return mrope_positions(input_ids, image_grid_thw, attention_mask, image_token_id=self.config.image_token_id,
                               video_token_id=self.config.video_token_id,
                               spatial_merge_size=self.config.spatial_merge_size)

    def _inputs(self, input_ids, pixel_values, image_grid_thw, image_embeds, videos, image_mask=None):
        """(inputs_embeds, image mask, deepstack features) with the image embeddings spliced in. `image_mask`: where
        the placeholders are, when not every image token is one (a trainer's responses: generated tokens are text)."""
        if videos:
            raise NotImplementedError("pixel_values_videos / video_grid_thw are not implemented by lathe's VL "
                                      "model; pass images only or use the transformers fallback")
        mask = self.image_mask(input_ids) if image_mask is None else image_mask
        embeds = self.get_input_embeddings()(input_ids)
        if image_embeds is None and pixel_values is not None:
            image_embeds = self.embed_images(pixel_values, image_grid_thw)
        if image_embeds is None:
            if bool(mask.any()):
                raise ValueError(f"input_ids hold {int(mask.sum())} image tokens but neither pixel_values nor "
                                 "image_embeds was given")
            return embeds, mask, None
        embeds = merge_image_embeddings(embeds, image_embeds.embeds, mask)
        return embeds, mask, image_embeds.deepstack

    # ---- forwards ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, *, image_embeds: ImageEmbeddings | None = None,
                pixel_values_videos=None, video_grid_thw=None, use_cache: bool = False, return_hidden: bool = False,
                **_ignored) -> CausalLMOutput:
        """Padded forward, called like transformers' VL model: `.logits` (B, L, V) (or `.hidden_states`)."""
        hidden = self._hidden_padded(input_ids, attention_mask, position_ids, pixel_values, image_grid_thw,
                                     image_embeds,
                                     pixel_values_videos is not None or video_grid_thw is not None)
        if return_hidden:
            return CausalLMOutput(hidden_states=hidden)
        return CausalLMOutput(logits=self.lm_head(hidden))

    def hidden_padded(self, input_ids, attention_mask=None, position_ids=None, pixel_values=None,
                      image_grid_thw=None, *, image_embeds=None, image_mask=None) -> torch.Tensor:
        """(B, L, H) final hidden states of a padded batch; padding positions hold unspecified values. `image_mask`
        (B, L): the placeholders, when not every image token is one (see `_inputs`)."""
        return self._hidden_padded(input_ids, attention_mask, position_ids, pixel_values, image_grid_thw,
                                   image_embeds, False, image_mask)

    def _hidden_padded(self, input_ids, attention_mask, position_ids, pixel_values, image_grid_thw, image_embeds,
                       videos, image_mask=None) -> torch.Tensor:
        embeds, mask, deepstack = self._inputs(input_ids, pixel_values, image_grid_thw, image_embeds, videos,
                                               image_mask)
        if position_ids is None:
            position_ids, _ = self.mrope_positions(input_ids, image_grid_thw, attention_mask)
        elif position_ids.dim() == 2:      # text positions: the same on all three axes
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        lm = self.model.language_model
        mode = self.padded_attention
        if attention_mask is None or mode == "mask" or (mode == "auto" and self.packed_backend() not in FLASH_BACKENDS):
            return lm(embeds, position_ids, PaddedAttention(attention_mask), mask, deepstack)
        if mode not in ("auto", "unpad"):
            raise ValueError(f"padded_attention={mode!r} is unknown; use 'auto', 'mask' or 'unpad'")
        real = attention_mask.bool()
        seqlens = real.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
        attn = PackedAttention(cu, int(seqlens.max()), self.packed_backend())
        hidden = lm(embeds[real], position_ids[:, real], attn, mask[real], deepstack)
        return hidden.new_zeros(*input_ids.shape, hidden.shape[-1]).index_put((real,), hidden)

    def hidden_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, pixel_values: torch.Tensor | None = None,
                      image_grid_thw: torch.Tensor | None = None, *,
                      image_embeds: ImageEmbeddings | None = None, image_mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """(T, H) final hidden states of a packed stream: `input_ids` (T,), `position_ids` (3, T) (see
        `packed_mrope_positions`), `cu_seqlens` (S+1,); the images in the order their placeholders appear;
        `image_mask` (T,): the placeholders, when not every image token is one (see `_inputs`)."""
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(3, -1)
        embeds, mask, deepstack = self._inputs(input_ids, pixel_values, image_grid_thw, image_embeds, False,
                                               image_mask)
        attn = PackedAttention(cu_seqlens.to(input_ids.device), int(max_seqlen), self.packed_backend())
        return self.model.language_model(embeds, position_ids, attn, mask, deepstack)

    def hidden_with(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn, pixel_values=None,
                    image_grid_thw=None, *, image_embeds: ImageEmbeddings | None = None,
                    image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) final hidden states of this rank's slice of a packed stream that a sequence-parallel group computes
        together (`attn`: `lathe.train.ulysses.UlyssesAttention`): `input_ids` (T,) and `position_ids` (3, T) are the
        whole stream's (`attn.local` takes this rank's slice of a whole-stream tensor). Every rank of the group splices
        the images into the whole stream's embeddings (the vision tower runs on all of them: each rank's loss reaches
        it through its own tokens only, and the group's partial gradients add up), then takes its slice of the
        embeddings, positions, placeholders and deepstack rows."""
        embeds, mask, deepstack = self._inputs(input_ids, pixel_values, image_grid_thw, image_embeds, False,
                                               image_mask)
        local = attn.local(embeds)
        positions = attn.local(position_ids.transpose(0, 1)).transpose(0, 1)
        if deepstack:                   # the rows of the image tokens that fall in this rank's slice
            first, per = attn.sp.rank * local.shape[0], local.shape[0]
            where = mask.nonzero().squeeze(1)
            mine = (where >= first) & (where < first + per)
            deepstack = [d[mine] for d in deepstack]
        return self.model.language_model(local, positions, attn, attn.local(mask), deepstack)

    def forward_packed(self, input_ids, position_ids, cu_seqlens, max_seqlen, pixel_values=None,
                       image_grid_thw=None, *, image_embeds=None, return_hidden: bool = True) -> torch.Tensor:
        """Packed forward: hidden (T, H) by default, logits (T, V) with `return_hidden=False`."""
        hidden = self.hidden_packed(input_ids, position_ids, cu_seqlens, max_seqlen, pixel_values, image_grid_thw,
                                    image_embeds=image_embeds)
        return hidden if return_hidden else self.lm_head(hidden)
