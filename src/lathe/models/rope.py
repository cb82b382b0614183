"""Rotary position embeddings with the scaling variants of Llama 3.x and Qwen configs.

The inverse frequencies are computed in float32 with the same operations, in the same order, as
transformers' `modeling_rope_utils`, so that cos/sin agree with it bit for bit in fp32. They live
in a plain attribute (not a buffer), so `model.to(torch.bfloat16)` never rounds them. transformers' modules keep
theirs in buffers (`inv_freq`), which `.to(bfloat16)` does round: `cast_keeping_rope` casts such a module (a
vision tower, a fallback model) as `from_pretrained(dtype=...)` leaves it, frequencies in float32.

Formulas: RoFormer (Su et al., 2021) for the base; linear position interpolation (Chen et al.,
2023); dynamic NTK scaling (bloc97/emozilla, 2023); YaRN (Peng et al., 2023); the Llama 3.1
frequency-band smoothing (Meta, 2024).
"""

from __future__ import annotations

import math

import torch

from lathe.models.config import RopeConfig

ROPE_BUFFERS = ("inv_freq", "original_inv_freq")     # transformers' rotary modules' frequency buffers


def cast_keeping_rope(module: torch.nn.Module, dtype: torch.dtype | None = None,
                      device: torch.device | str | None = None) -> torch.nn.Module:
    """`module.to(device, dtype)` with transformers' RoPE frequency buffers (`ROPE_BUFFERS`) left in their dtype
    (float32), as `from_pretrained(dtype=...)` leaves them. Cast to bf16 they round by up to 2^-9 relative, which
    turns position p's angles by up to p * 2^-9 radians: another model than the checkpoint's (a bf16 reference or
    rollout copy of a vision tower would then differ from the trainer's float32 one), and `.float()` does not undo
    it."""
    kept = {name: buf for name, buf in module.named_buffers() if name.rpartition(".")[2] in ROPE_BUFFERS}
    module.to(device=device, dtype=dtype)
    for name, buf in kept.items():
        owner, _, attr = name.rpartition(".")
        sub = module.get_submodule(owner)
        setattr(sub, attr, buf.to(device=getattr(sub, attr).device))
    return module


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """1 / base^(2i/dim) for i < dim/2, float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim))


def llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between smoothly blended."""
    inv_freq = default_inv_freq(rope.rope_theta, dim)
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_inv_freq(rope: RopeConfig, dim: int, seq_len: int, max_position_embeddings: int) -> torch.Tensor:
    """Dynamic NTK: the base grows once the sequence outgrows `max_position_embeddings`."""
    seq_len = max(seq_len, max_position_embeddings)
    factor = rope.factor
    base = rope.rope_theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim)


def yarn_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; also the cos/sin scale."""
    base, orig = rope.rope_theta, rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Computes (cos, sin) of shape (*position_ids.shape, head_dim) for given positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int):
        super().__init__()
        self.rope, self.head_dim, self.max_position_embeddings = rope, head_dim, max_position_embeddings
        self.attention_scaling = 1.0
        if rope.rope_type == "yarn":
            self.inv_freq, self.attention_scaling = yarn_inv_freq(rope, head_dim, max_position_embeddings)
        elif rope.rope_type == "llama3":
            self.inv_freq = llama3_inv_freq(rope, head_dim)
        elif rope.rope_type == "linear":
            self.inv_freq = default_inv_freq(rope.rope_theta, head_dim) / rope.factor
        else:   # default; dynamic starts from the unscaled frequencies
            self.inv_freq = default_inv_freq(rope.rope_theta, head_dim)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.rope.rope_type == "dynamic":
            seq_len = int(position_ids.max().item()) + 1
            if seq_len > self.max_position_embeddings:
                return dynamic_inv_freq(self.rope, self.head_dim, seq_len,
                                        self.max_position_embeddings).to(position_ids.device)
        dev = position_ids.device
        if dev not in self._on_device:
            self._on_device[dev] = self.inv_freq.to(dev)
        return self._on_device[dev]

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self._inv_freq(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (..., heads, head_dim) by cos/sin (..., rotary_dim), broadcast over heads: the first rotary_dim
    features of each head when cos is narrower (partial RoPE: GLM-4.5, Qwen3.5), the rest passing unturned."""
    dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if dim == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    turned, kept = x[..., :dim], x[..., dim:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)
