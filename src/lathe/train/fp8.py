"""FP8 training of the actor's linear layers through torchao's float8 (`actor.fsdp_config.fp8_training`).

`convert` swaps the projections of the policy's decoder layers (q/k/v/o, gate/up/down, the hybrid families' and
MLA's projections) for torchao's `Float8Linear`: each forward casts the input and the weight to float8_e4m3 with
scales computed from the current tensors (dynamic scaling, no amax history), and backward casts the output
gradient, so the three matrix products of a linear layer (two with `rowwise_with_gw_hp`) run on the FP8 tensor cores
(`torch._scaled_mm`) while the weights, their gradients, the optimizer and everything outside those products stay as
they were (bf16 compute on fp32 master weights). Recipes (`torchao.float8.Float8LinearRecipeName`):

- `tensorwise`: one scale per tensor, e4m3 forward and e5m2 gradients (Megatron's `fp8=hybrid` with
  `fp8_recipe=tensorwise`); at 7B the update 1.24x bf16 (`rowwise_with_gw_hp` 1.14x there, another call);
- `rowwise`: one scale per row, e4m3 throughout, scales rounded down to powers of two; more accurate, slower;
- `rowwise_with_gw_hp`: row-wise scales for the forward and the input gradient's products, the weight gradient's
  product in bf16 (no transposed FP8 copies of the activations and output gradients, the casts that ate tensorwise's
  gain at 1.5B: `bench/results/e2e_profile_fp8train_ab_*_1.5b_nvidia-h200.json`); it converts the layers tensorwise
  does (torchao gives it no size rule). The faster below 7B: the 1.5B update 1.04x bf16 where tensorwise made 1.02x,
  the 0.5B update even where tensorwise lost 8% (`e2e_fp8train_gw_ab_*`).

Every product pads its inner dim to a multiple of 16 (`float8_config`): the weight gradient's runs over the tokens of
a packed micro-batch, whose count is arbitrary.

What stays in bf16: the embeddings, the lm_head (its log-softmax is where precision matters most), the routers and
the routed experts of a mixture of experts (stacked 3-D weights run by grouped GEMMs, not `nn.Linear`), norms, any
layer whose two dims are not multiples of 16 (`_scaled_mm`'s rule), and layers too small for FP8 to pay (`pays`,
torchao's measured thresholds: at tensorwise, out <= 1024 with in <= 4096, such as the k/v projections of Qwen2.5). The parameters are the very tensors they
were (a `Float8Linear` is an `nn.Linear` holding the same `weight` and `bias`), so the state dict, checkpoints and
the weights the rollout engine receives are plain tensors under the usual names: a checkpoint written with FP8
training loads in a run without it. The reference policy and the rollout take their copies before `convert` runs,
and the critic is not converted: they compute in bf16.

FSDP2: the layers are converted before `fully_shard`, which then gathers the bf16 weights and each forward casts
them (torchao's float8 all-gather, `enable_fsdp_float8_all_gather`, is not used: its gathered weights are float8
tensors, which lathe's weight sync, resharding and full-state reads would receive instead of the bf16 weights).

FP8 products need an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell): `check_device` fails
before any model loads elsewhere. torchao's emulation (float8 casts with high-precision products) runs on any
device, for lathe's tests only (`emulated`); a user's run never falls back to it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

log = logging.getLogger("lathe")

KEY = "actor_rollout_ref.actor.fsdp_config.fp8_training"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")   # lathe.config.choices.Fp8Recipe mirrors it
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")   # a router as an nn.Linear (transformers' MoE blocks)
_emulate = False                          # set by `emulated()` (tests only)


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Inside: `convert` builds torchao's emulated FP8 layers (float8 casts, high-precision products) and
    `check_device` accepts any device. For lathe's tests on CPUs; a run never enters it."""
    global _emulate
    before, _emulate = _emulate, True
    try:
        yield
    finally:
        _emulate = before


def check_device(recipe: str | None, device: torch.device, key: str = KEY) -> None:
    """`recipe` (None: off) can run on `device`: torchao installed, an NVIDIA GPU of compute capability >= 8.9."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ValueError(f"{key}={recipe!r}: the recipes are {', '.join(RECIPES)} (null: bf16). Fix: set one of them.")
    from lathe.device import nvidia_capability
    capability = nvidia_capability(device)
    if not _emulate and (capability is None or capability < (8, 9)):
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else f"a {device.type} device"
        raise ValueError(f"{key}={recipe}: FP8 training needs an NVIDIA GPU of compute capability 8.9 or later (Ada, "
                         f"Hopper, Blackwell) for its FP8 matrix products, but the actor runs on {where}. Fix: "
                         f"remove {key} (bf16 training) or run on such a GPU.")
    _torchao(key)          # (after the device: on a CPU torchao's import logs its GPU libraries failing to load)


def _torchao(key: str):
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(f"{key} needs torchao's float8 training (`pip install 'lathe[fp8]'`, or `pip install "
                          f"--no-deps torchao` beside the installed torch); it failed to import: {e}") from e
    return float8


def float8_config(recipe: str):
    """torchao's `Float8LinearConfig` of `recipe` (emulated inside `emulated()`), with `pad_inner_dim`: the weight
    gradient's product runs over the tokens, and `torch._scaled_mm` needs its inner dim a multiple of 16, which a
    packed micro-batch's token count seldom is (torchao pads the FP8 operands with zeros, which add nothing)."""
    import dataclasses
    float8 = _torchao(KEY)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, pad_inner_dim=True, emulate=_emulate)


def pays(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's measured rule (H100) for where FP8 beats bf16 (`torchao.float8._auto_filter_for_recipe`): below these
    sizes the casts cost more than the FP8 product saves. Emulated (tests): every size, so tiny models convert."""
    n, k = out_features, in_features
    if _emulate:
        return True
    if recipe in ("tensorwise", "rowwise_with_gw_hp"):      # (torchao has no rule for the latter: tensorwise's)
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def targets(model: nn.Module, recipe: str = "tensorwise") -> list[str]:
    """Names of the linear layers `convert` swaps: plain `nn.Linear`s inside the language model's decoder layers
    (not the vision tower's, not MTP layers'), routers excluded, both dims multiples of 16, large enough that FP8
    `pays`."""
    from lathe.models.vl import LatheVLForConditionalGeneration
    if isinstance(model, LatheVLForConditionalGeneration):
        layers = model.model.language_model.layers
    else:
        layers = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)
    if layers is None:
        return []
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [name for name, m in model.named_modules()
            if type(m) is nn.Linear and id(m) in inside and name.rsplit(".", 1)[-1] not in ROUTER_NAMES
            and m.in_features % 16 == 0 and m.out_features % 16 == 0 and pays(recipe, m.out_features, m.in_features)]


def convert(model: nn.Module, recipe: str | None) -> list[str]:
    """Swap `targets(model)` for torchao's `Float8Linear` of `recipe`, in place (None: nothing); the names swapped.
    Call it before sharding, compiling and building the optimizer (the parameters stay the same tensors)."""
    if recipe is None:
        return []
    names = set(targets(model, recipe))
    if not names:
        raise ValueError(f"{KEY}={recipe}: {type(model).__name__} has no linear layer FP8 training applies to "
                         "(nn.Linear inside the decoder layers, both dims multiples of 16, large enough for FP8 to "
                         "pay: lathe.train.fp8.pays). Fix: remove the key.")
    float8 = _torchao(KEY)
    float8.convert_to_float8_training(model, config=float8_config(recipe),
                                      module_filter_fn=lambda m, fqn: fqn in names)
    log.info("actor: FP8 training (torchao float8, %s scaling%s) of %d linear layers; embeddings, lm_head, routers "
             "and routed experts in bf16", recipe, ", emulated" if _emulate else "", len(names))
    return sorted(names)


def is_converted(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Float8Linear" for m in model.modules())
