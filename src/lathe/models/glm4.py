"""GLM-4's checkpoints (Glm4ForCausalLM: GLM-4-9B/32B-0414, GLM-Z1; the language model of GLM-4.1V) in lathe's
decoder layers, whose math is Qwen2's attention (q/k/v biases) with partial RoPE and two more norms
(`LatheConfig.post_norms`: the attention's and the MLP's outputs are normed before each residual add,
`decoder.DecoderLayer`). What differs is on disk, and this module converts it both ways:

- RoPE's pairs: GLM-4 turns the rotary features of each q/k head as interleaved pairs (x0, x1), (x2, x3), ... (pair i
  by frequency i), lathe (and its engine's kernels) as halves (x_i, x_{i + r/2}). A score q.k is the same under one
  permutation of both q's and k's features, so the modules hold the q/k projections' rows (and biases) of each head
  with the even rotary features first, then the odd ones (`rope_order`): pair i becomes (i, i + r/2), turned by the
  same frequency i. Values and the features past the rotary ones keep their places. `to_modules` permutes the rows on
  reading, `to_hub` puts them back on writing.
- the MLP's gate and up projections are one `gate_up_proj` (gate the first half of its rows): split into lathe's
  `gate_proj` / `up_proj` on reading (the engine fuses them again, `engine.decode_forms`), concatenated on writing.

LoRA adapters in PEFT's layout take the same conversion (`adapter_to_modules`, `adapter_to_hub`): q/k's `lora_B`
rows are permuted; a `gate_up_proj` adapter (A, B) becomes the two adapters (A, B's gate rows) and (A, B's up rows),
exact; written back, lathe's two are one adapter of twice the rank (A's stacked, B block-diagonal), which computes
the same, under PEFT's `rank_pattern` / `alpha_pattern`.
"""

from __future__ import annotations

import functools

import torch

_ROTATED = (".self_attn.q_proj.", ".self_attn.k_proj.")
_GATE_UP = ".mlp.gate_up_proj."
# the language model's layers (a GLM-4.1V checkpoint's too; its vision tower's MLPs are gate_proj / up_proj already)
_TEXT = ("model.layers.", "model.language_model.layers.")


@functools.cache
def rope_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The feature order of a head in lathe's modules, as indices into the checkpoint's: the rotary features' even
    ones, their odd ones, then the unturned rest."""
    idx = torch.arange(rotary_dim)
    return torch.cat([idx[0::2], idx[1::2], torch.arange(rotary_dim, head_dim)])


def _heads_rows(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`t`'s rows (a projection's weight or bias, heads x head_dim rows) reordered within each head by `order`."""
    d = order.numel()
    return t.reshape(-1, d, *t.shape[1:])[:, order].reshape(t.shape)


def _orders(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    order = rope_order(cfg.head_dim, cfg.rotary_dim)
    return order, torch.argsort(order)


def _rotated(name: str) -> bool:
    """Whether tensor `name` is a q or k projection's (its rows in the heads' feature order)."""
    return name.startswith(_TEXT) and any(part in name for part in _ROTATED)


def _mlp(name: str, part: str) -> bool:
    """Whether tensor `name` is of a language-model layer's MLP projection `part` (".mlp.gate_up_proj." ...)."""
    return name.startswith(_TEXT) and part in name


def to_modules(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A GLM-4 checkpoint's tensors in lathe's module layout (module doc)."""
    order, _ = _orders(cfg)
    out = {}
    for name, t in state.items():
        if _mlp(name, _GATE_UP) and ".lora_" not in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace(_GATE_UP, ".mlp.gate_proj.")] = gate
            out[name.replace(_GATE_UP, ".mlp.up_proj.")] = up
        elif _rotated(name):
            out[name] = _heads_rows(t, order)
        else:
            out[name] = t
    return out


def to_hub(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """`to_modules` undone: the tensors as GLM-4's checkpoints hold them."""
    _, inverse = _orders(cfg)
    out = {}
    for name, t in state.items():
        if _mlp(name, ".mlp.gate_proj.") and ".lora_" not in name:
            out[name.replace(".mlp.gate_proj.", _GATE_UP)] = torch.cat([t, state[name.replace("gate_proj", "up_proj")]])
        elif _mlp(name, ".mlp.up_proj.") and ".lora_" not in name:
            continue
        elif _rotated(name):
            out[name] = _heads_rows(t, inverse)
        else:
            out[name] = t
    return out


def module_names(names) -> set[str]:
    """The module names of a checkpoint's tensor names (`to_modules` without the tensors)."""
    out = set()
    for name in names:
        if _mlp(name, _GATE_UP):
            out |= {name.replace(_GATE_UP, ".mlp.gate_proj."), name.replace(_GATE_UP, ".mlp.up_proj.")}
        else:
            out.add(name)
    return out


def _adapter_split(name: str, a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[tuple, tuple]:
    """((A, B) of gate, (A, B) of up) from one `gate_up_proj` adapter (module doc), of rank `rank` each."""
    inter = b.shape[0] // 2
    if a.shape[0] == rank:                     # PEFT's own: one A shared by gate and up
        return (a, b[:inter]), (a, b[inter:])
    off = (b[:inter, rank:], b[inter:, :rank])
    if a.shape[0] == 2 * rank and not any(t.count_nonzero() for t in off):     # lathe's: B block-diagonal
        return (a[:rank], b[:inter, :rank]), (a[rank:], b[inter:, rank:])
    raise ValueError(f"{name}: a gate_up_proj adapter of rank {a.shape[0]} does not make two adapters of rank "
                     f"{rank} (lathe adapts gate_proj and up_proj apart: rank r with one A, or 2r with B "
                     "block-diagonal, as lathe saves them). Fix: set lora_rank to the adapter's r.")


def adapter_to_modules(tensors: dict[str, torch.Tensor], cfg, rank: int) -> dict[str, torch.Tensor]:
    """A GLM-4 PEFT adapter's tensors (lathe's paths, `<path>.lora_A` / `.lora_B`) for lathe's LoRA layers of rank
    `rank` (module doc)."""
    order, _ = _orders(cfg)
    out = {}
    for name, t in tensors.items():
        if _mlp(name, _GATE_UP) and name.endswith(".lora_A"):
            base = name[:-len(".lora_A")]
            gate, up = _adapter_split(base, t, tensors[base + ".lora_B"], rank)
            for proj, (a, b) in (("gate_proj", gate), ("up_proj", up)):
                stem = base.replace(_GATE_UP[:-1], f".mlp.{proj}")
                out[stem + ".lora_A"], out[stem + ".lora_B"] = a, b
        elif _mlp(name, _GATE_UP):
            continue
        elif _rotated(name) and name.endswith(".lora_B"):
            out[name] = _heads_rows(t, order)
        else:
            out[name] = t
    return out


def adapter_to_hub(tensors: dict[str, torch.Tensor], cfg) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """`adapter_to_modules` undone: (the tensors by lathe's paths as GLM-4's modules name them, each written
    gate_up_proj's rank in units of lathe's rank by its path: 2 where both gate and up are adapted)."""
    _, inverse = _orders(cfg)
    out, ranks = {}, {}
    for name, t in tensors.items():
        if _mlp(name, ".mlp.gate_proj.") or _mlp(name, ".mlp.up_proj."):
            continue
        out[name] = _heads_rows(t, inverse) if _rotated(name) and name.endswith(".lora_B") else t
    stems = {n.rsplit(".mlp.", 1)[0] for n in tensors if _mlp(n, ".mlp.gate_proj.") or _mlp(n, ".mlp.up_proj.")}
    for stem in sorted(stems):
        parts = [(tensors.get(f"{stem}.mlp.{p}.lora_A"), tensors.get(f"{stem}.mlp.{p}.lora_B"))
                 for p in ("gate_proj", "up_proj")]
        inter = next(b.shape[0] for a, b in parts if b is not None)
        present = [(i, a, b) for i, (a, b) in enumerate(parts) if a is not None]
        rank = present[0][1].shape[0]
        big_b = present[0][2].new_zeros(2 * inter, rank * len(present))
        for col, (i, _, b) in enumerate(present):
            big_b[i * inter:(i + 1) * inter, col * rank:(col + 1) * rank] = b
        out[f"{stem}.mlp.gate_up_proj.lora_A"] = torch.cat([a for _, a, _ in present])
        out[f"{stem}.mlp.gate_up_proj.lora_B"] = big_b
        ranks[f"{stem}.mlp.gate_up_proj"] = len(present)
    return out, ranks
