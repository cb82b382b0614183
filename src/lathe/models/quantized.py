"""Quantised checkpoints read as unquantised weights: the block-FP8 checkpoints DeepSeek-V3, Kimi-K2, Qwen3 and GLM
ship (`quantization_config.quant_method: fp8`), and compressed-tensors' FP8 and INT4 formats (`quant_method:
compressed-tensors`: RedHat's `*-FP8-dynamic` checkpoints, Kimi-K2-Thinking's and Kimi-K2.6's INT4 experts).

RL training updates every weight in bf16 or fp32, so `lathe.models.io.read_state_dict` dequantises each quantised
weight as it is read, once all its parts are in (they may sit in different shards), and the model never sees the
quantised tensors.
Checkpoints lathe saves are then unquantised, their `config.json` without `quantization_config`
(`lathe.models.io.export_config`); the rollout engine gets the same weights (and `rollout.quantization=fp8`
quantises them again in its own format).

The formats, as their writers define them:

- `fp8`: `X.weight` float8_e4m3fn and `X.weight_scale_inv` (float32, or UE8M0 where `scale_fmt: ue8m0`), one scale
  per `weight_block_size` block [rows, cols] (the last blocks partial), or one for the tensor without it:
  w = q * scale_inv. Only the weights are quantised (`activation_scheme: dynamic`: activations are quantised at
  inference, which training does not do).
- compressed-tensors `float-quantized`, FP8 weights: `X.weight` float8_e4m3fn and `X.weight_scale` per tensor,
  per output channel ([rows, 1]) or per `block_structure` block: w = q * scale.
- compressed-tensors `pack-quantized`, symmetric INT4 weights in groups along the input dimension (or one group a
  row: the `channel` strategy): `X.weight_packed`
  int32 [rows, ceil(cols / 8)], element i of a row at bits 4i..4i+3 of its word (i mod 8) stored as q + 8;
  `X.weight_scale` [rows, cols / group_size]; `X.weight_shape` [rows, cols]: w = q * scale of its group.

Anything else (activation scales of static schemes, zero points, other bit widths, MXFP4) is refused with the
config's key named; the transformers fallback then runs the checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("lathe")

FALLBACK = "; the transformers fallback will be used"
# the parts of a quantised weight `X.weight`, by the suffix that replaces `.weight`
FP8_SCALE_INV, SCALE, PACKED, SHAPE = ".weight_scale_inv", ".weight_scale", ".weight_packed", ".weight_shape"
PART_SUFFIXES = (FP8_SCALE_INV, SCALE, PACKED, SHAPE)


@dataclass(frozen=True)
class Scheme:
    """How a checkpoint's weights are quantised: `fp8` (`weight_block_size` or per tensor), `fp8-ct`
    (compressed-tensors' FP8: per tensor, per row, or per `block`) or `int4` (packed, `group_size` columns a scale, 0:
    a row)."""

    method: str
    block: tuple[int, int] | None = None
    group_size: int = 0

    def describe(self) -> str:
        if self.method == "fp8":
            return f"FP8 weights, {'x'.join(map(str, self.block)) + ' blocks' if self.block else 'one scale each'}"
        if self.method == "int4":
            return f"INT4 weights in groups of {self.group_size}" if self.group_size else "INT4 weights, a scale a row"
        return "FP8 weights (compressed-tensors)"


def _refuse(source: str, what: str, fix: str = "point the model path at an unquantised (bfloat16) checkpoint"):
    from lathe.models.config import UnsupportedArchitecture
    raise UnsupportedArchitecture(f"{source}: {what}; lathe reads block-FP8 (quant_method 'fp8') and compressed-tensors"
                                  f" FP8 or symmetric INT4 weight-only checkpoints. Fix: {fix}{FALLBACK}")


def scheme(d: dict[str, Any], source: str) -> Scheme | None:
    """The `Scheme` of a config.json dictionary `d`, None when it has no `quantization_config`; a scheme lathe does
    not read raises `UnsupportedArchitecture` naming the key."""
    q = d.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    key = "quantization_config"
    if method == "fp8":
        if q.get("activation_scheme", "dynamic") != "dynamic":
            _refuse(source, f"{key}.activation_scheme={q.get('activation_scheme')!r} (static activation scales)")
        if q.get("fmt", "e4m3") != "e4m3":
            _refuse(source, f"{key}.fmt={q.get('fmt')!r} (lathe reads e4m3 weights)")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
            _refuse(source, f"{key}.weight_block_size={block!r} (two positive sizes: rows, columns)")
        return Scheme("fp8", tuple(int(b) for b in block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(q, source)
    fix = ("dequantise it first: load it with transformers and `quantization_config=Mxfp4Config(dequantize=True)`, "
           "then `save_pretrained` it (bfloat16 experts), and point the model path at that directory"
           if method == "mxfp4" else "point the model path at an unquantised (bfloat16) checkpoint")
    _refuse(source, f"it is quantised ({key}.quant_method={method!r})", fix)


def _compressed_tensors(q: dict[str, Any], source: str) -> Scheme:
    key = "quantization_config"
    fmt, status = q.get("format"), q.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse(source, f"{key}.quantization_status={status!r} (lathe reads compressed checkpoints)")
    groups = q.get("config_groups") or {}
    if not groups:
        _refuse(source, f"{key} has no config_groups")
    schemes = set()
    for name, group in groups.items():
        where = f"{key}.config_groups.{name}"
        for side in ("input_activations", "output_activations"):
            act = group.get(side)
            if act and not (side == "input_activations" and act.get("dynamic") is True):
                _refuse(source, f"{where}.{side} quantises activations with stored scales")
        w = group.get("weights") or {}
        fmt_here = group.get("format") or fmt
        if w.get("dynamic") or w.get("actorder") or not w.get("symmetric", True) or w.get("zp_dtype"):
            _refuse(source, f"{where}.weights={w} (lathe reads static, symmetric weights without act-order)")
        if fmt_here == "pack-quantized" and w.get("type") == "int" and int(w.get("num_bits", 0)) == 4 \
                and w.get("strategy") == "group" and int(w.get("group_size") or 0) > 0:
            schemes.add(Scheme("int4", group_size=int(w["group_size"])))
        elif fmt_here == "pack-quantized" and w.get("type") == "int" and int(w.get("num_bits", 0)) == 4 \
                and w.get("strategy") == "channel":
            schemes.add(Scheme("int4"))             # (one scale per row: a group of the whole row)
        elif fmt_here == "float-quantized" and w.get("type") == "float" and int(w.get("num_bits", 0)) == 8 \
                and w.get("strategy") in ("tensor", "channel"):
            schemes.add(Scheme("fp8-ct"))
        elif fmt_here == "float-quantized" and w.get("type") == "float" and int(w.get("num_bits", 0)) == 8 \
                and w.get("strategy") == "block" and len(w.get("block_structure") or ()) == 2:
            schemes.add(Scheme("fp8-ct", tuple(int(b) for b in w["block_structure"])))
        else:
            _refuse(source, f"{where} is {fmt_here!r} with weights {w}")
    if len(schemes) > 1:
        _refuse(source, f"{key} mixes weight formats ({', '.join(s.describe() for s in schemes)})")
    return schemes.pop()


def checkpoint_scheme(path: str | Path) -> Scheme | None:
    """The `Scheme` of a checkpoint directory's config.json (None without one or without quantisation)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    with open(file) as f:
        d = json.load(f)
    return scheme(d, str(file))


class Dequantizer:
    """Collects a quantised checkpoint's tensors as they are read and hands back each weight dequantised (in `dtype`,
    bfloat16 where the reader asks for none) once all its parts are in. `take(name, tensor)` returns the (name,
    tensor) pairs ready; `finish()` raises for parts left without their weight or scale."""

    def __init__(self, scheme: Scheme, dtype, source: str):
        self.scheme, self.dtype, self.source = scheme, dtype, source
        self.pending: dict[str, dict[str, Any]] = {}
        self.count = 0

    def wants(self, name: str, tensor) -> bool:
        """Whether `name` is part of a quantised weight (an FP8 tensor, or a scale / packed / shape part)."""
        import torch
        return name.endswith(PART_SUFFIXES) or tensor.dtype == torch.float8_e4m3fn

    def take(self, name: str, tensor) -> list[tuple[str, Any]]:
        base, part = _split(name)
        parts = self.pending.setdefault(base, {})
        parts[part] = tensor
        need = {"int4": (PACKED, SCALE, SHAPE), "fp8": (".weight", FP8_SCALE_INV),
                "fp8-ct": (".weight", SCALE)}[self.scheme.method]
        if any(p not in parts for p in need):
            return []
        del self.pending[base]
        extra = sorted(set(parts) - set(need))
        if extra:
            raise ValueError(f"{self.source}: {base}.weight comes with {', '.join(base + p for p in extra)}, which "
                             f"{self.scheme.describe()} does not use; the checkpoint is not of its config's scheme")
        self.count += 1
        import torch
        if self.scheme.method == "int4":
            w = dequantize_int4(parts[PACKED], parts[SCALE], parts[SHAPE], self.scheme.group_size, base)
        elif self.scheme.method == "fp8":
            w = dequantize_fp8(parts[".weight"], parts[FP8_SCALE_INV], self.scheme.block, base)
        else:
            w = dequantize_fp8(parts[".weight"], parts[SCALE], self.scheme.block, base, per_row=True)
        return [(base + ".weight", w.to(torch.bfloat16 if self.dtype is None else self.dtype))]

    def finish(self) -> None:
        if self.pending:
            base, parts = next(iter(self.pending.items()))
            raise ValueError(f"{self.source}: {base} has {', '.join(base + p for p in sorted(parts))} but not all "
                             f"the parts of {self.scheme.describe()} ({len(self.pending)} weights so); the checkpoint "
                             "is incomplete or not of its config's scheme")
        if self.count:
            log.info("%s: %d weights dequantised from %s; the model trains them unquantised and saves them so "
                     "(config.json without quantization_config)", self.source, self.count, self.scheme.describe())


def _split(name: str) -> tuple[str, str]:
    for suffix in PART_SUFFIXES + (".weight",):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    raise ValueError(f"{name}: an FP8 tensor that is not a weight (lathe dequantises `<module>.weight` tensors)")


def dequantize_fp8(q, scale, block: tuple[int, int] | None, name: str, *, per_row: bool = False):
    """float32 `q * scale`: one scale per `block` of q (the last ones partial), or, with `block` None, a scale of
    one element, or (`per_row`: compressed-tensors' channel strategy) one per row."""
    import torch
    w, s = q.to(torch.float32), scale.to(torch.float32)
    rows, cols = w.shape[-2:]
    if block is None and s.numel() == 1:
        return w * s.reshape(())
    if block is None and per_row and s.shape[-2:] == (rows, 1):
        return w * s
    if block is None:
        raise ValueError(f"{name}: a scale of shape {tuple(s.shape)} for a weight of {tuple(w.shape)} and no "
                         "block size in quantization_config")
    br, bc = block
    if s.shape[-2:] != (-(-rows // br), -(-cols // bc)):
        raise ValueError(f"{name}: {tuple(s.shape)} scales for a {tuple(w.shape)} weight in {br}x{bc} blocks; "
                         f"expected {(-(-rows // br), -(-cols // bc))}")
    full = s.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return w * full


def unpack_int4(packed, rows: int, cols: int, name: str):
    """int8 [rows, cols] from compressed-tensors' packing (module doc)."""
    import torch
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // 8)):
        raise ValueError(f"{name}.weight_packed: {packed.dtype} {tuple(packed.shape)} for a [{rows}, {cols}] weight; "
                         f"expected int32 [{rows}, {-(-cols // 8)}] (4-bit values packed along the input dimension)")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF          # (rows, words, 8): element 8j + i at bits 4i
    return (nibbles.reshape(rows, -1)[:, :cols] - 8).to(torch.int8)


def dequantize_int4(packed, scale, shape, group_size: int, name: str):
    """float32 [rows, cols] = q * the scale of its group of `group_size` input columns."""
    import torch
    rows, cols = (int(v) for v in shape.tolist())
    group_size = group_size or cols         # (0: one scale per row)
    if cols % group_size or tuple(scale.shape) != (rows, cols // group_size):
        raise ValueError(f"{name}.weight_scale: {tuple(scale.shape)} for a [{rows}, {cols}] weight in groups of "
                         f"{group_size}; expected {(rows, cols // group_size)}")
    q = unpack_int4(packed, rows, cols, name).to(torch.float32)
    return q * scale.to(torch.float32).repeat_interleave(group_size, dim=-1)
