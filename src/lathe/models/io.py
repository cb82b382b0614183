"""Reading and writing Hugging Face checkpoint directories for lathe's decoder, and copying weights by name.

Parameter names already match the checkpoints, so loading is a plain safetensors read (one file, or
shards listed in `model.safetensors.index.json`; `pytorch_model.bin` as a last resort) and saving is a
plain safetensors write plus `config.json`, which `transformers.AutoModelFor*.from_pretrained` reads back.
The one layout that differs is a Qwen3-MoE model's experts: one tensor per expert and projection on disk, stacked in
the modules (`lathe.models.moe.fuse_expert_weights` on load, `split_expert_weights` on save); GPT-OSS's checkpoints
hold the stacked tensors themselves. HY-V3's checkpoints name three of its MoE tensors otherwise (`HUB_NAMES`:
`module_layout` on load, `hub_layout` on save). A MiMo checkpoint's multi-token-prediction layers
(`model.mtp_layers.*`, `lathe.models.mtp`) load and save under their own names like every other tensor; DeepSeek-V3's,
GLM-4.5's, HY-V3's (`model.layers.<n>`), Qwen3.5's and Qwen3-Next's (`mtp.*`) are dropped on load, with a warning,
and copied unchanged into saves with `actor_rollout_ref.model.mtp.enable=true` (`stacked_mtp_tensors`).
A quantised checkpoint's weights are read dequantised (`lathe.models.quantized`) and saved so.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from lathe.models.config import LatheConfig, UnsupportedArchitecture
from lathe.models.moe import fuse_expert_weights, split_expert_weights
from lathe.models.quantized import Dequantizer, checkpoint_scheme

log = logging.getLogger("lathe")

SAFE_SINGLE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_SINGLE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# Buffers some older checkpoints carry; lathe recomputes them from the config.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Tensors read in their stored dtype whatever `dtype` asks: DeepSeek-V3's expert-selection bias (float32, as
# transformers keeps it; `lathe.models.deepseek.DeepseekRouter`), HY-V3's under its checkpoints' name
_KEPT_DTYPE = re.compile(r"\.(?:mlp|mixer)\.(gate\.e_score_correction_bias|expert_bias)$")
# Checkpoint names that are not lathe's module names, by `LatheConfig.family`: (on disk, in the modules). HY-V3's
# router, selection bias and shared experts (DeepseekMoeBlock's gate, gate.e_score_correction_bias, shared_experts)
HUB_NAMES = {"hyv3": ((".mlp.router.gate.weight", ".mlp.gate.weight"),
                      (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
                      (".mlp.shared_mlp.", ".mlp.shared_experts.")),
             # Nemotron-H's `backbone.*`, its embeddings and final norm (`lathe.models.nemotron_h`)
             "nemotronh": (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
                           ("backbone.", "model."))}
# ... and the names transformers' modules hold where they are neither (read by `lathe.models.hf`'s conversion)
MODULE_ALIASES = {"hyv3": ((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),),
                  "nemotronh": (("model.embeddings.", "model.embed_tokens."), ("model.norm_f.", "model.norm."))}


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory, in load order."""
    path = Path(path)
    for single, index in ((SAFE_SINGLE, SAFE_INDEX), (BIN_SINGLE, BIN_INDEX)):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            with open(path / index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            missing = [n for n in names if not (path / n).is_file()]
            if missing:
                raise FileNotFoundError(f"{path / index} lists shards that are not there: {', '.join(missing)}; "
                                        "copy the whole checkpoint directory")
            return [path / n for n in names]
    raise FileNotFoundError(f"{path}: no {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}; a Hugging "
                            "Face checkpoint directory holds its weights in one of these")


def read_state_dict(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu", prefixes: tuple[str, ...] | None = None,
                    select: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, cast to `dtype` (floating tensors only) on `device`; with `prefixes`
    only those whose names start with one of them, with `select` those it keeps (read alone from safetensors files: a
    large model's other weights are not read)."""
    if prefixes is not None:
        select = (lambda name: name.startswith(prefixes)) if select is None else select
    state: dict[str, torch.Tensor] = {}
    scheme = checkpoint_scheme(path)
    quantized = Dequantizer(scheme, dtype, str(path)) if scheme is not None else None
    for file in weight_files(path):
        if file.suffix == ".safetensors" and select is not None:
            from safetensors import safe_open
            with safe_open(str(file), framework="pt", device=str(device)) as handle:
                part = {k: handle.get_tensor(k) for k in handle.keys() if select(k)}
        elif file.suffix == ".safetensors":
            from safetensors.torch import load_file
            part = load_file(str(file), device=str(device))
        else:
            part = torch.load(file, map_location=device, weights_only=True)
        for name, t in part.items():
            if select is not None and not select(name):
                continue
            if _IGNORED.search(name):
                continue
            if quantized is not None and quantized.wants(name, t):
                state.update(quantized.take(name, t))
                continue
            cast = dtype is not None and t.is_floating_point() and not _KEPT_DTYPE.search(name)
            state[name] = t.to(dtype) if cast else t
    if quantized is not None:
        quantized.finish()
    return state


def _renamed(name: str, pairs) -> str:
    for old, new in pairs:
        if old in name:
            return name.replace(old, new, 1)
    return name


def _to_modules(cfg) -> tuple[tuple[str, str], ...]:
    family = getattr(cfg, "family", None)      # (a transformers model's config, impl=hf, has none: no renames)
    return HUB_NAMES.get(family, ()) + MODULE_ALIASES.get(family, ())


def module_names(names: Iterable[str], cfg) -> set[str]:
    """The module names of a checkpoint's tensor names (`module_layout`'s, without reading the tensors)."""
    from lathe.models.moe import fused_names
    pairs = _to_modules(cfg)
    names = (_renamed(n, pairs) for n in names)
    if _glm4(cfg) is not None:         # GLM-4: gate_up_proj read as gate_proj + up_proj
        from lathe.models import glm4
        names = glm4.module_names(names)
    return fused_names(names)


def module_layout(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under lathe's module names: per-expert MoE weights fused, `HUB_NAMES` renamed."""
    pairs = _to_modules(cfg)
    state = fuse_expert_weights({_renamed(k, pairs): v for k, v in state.items()} if pairs else state)
    text = _glm4(cfg)
    if text is not None:               # GLM-4's RoPE pairs and fused gate/up (`lathe.models.glm4`)
        from lathe.models import glm4
        state = glm4.to_modules(state, text)
    return state


def _glm4(cfg):
    """The language model's config where it is GLM-4's (GLM-4.1V's too: `lathe.models.glm4`), else None."""
    text = getattr(cfg, "text", cfg)
    return text if getattr(text, "rope_interleave", False) else None


def hub_layout(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The modules' tensors under the checkpoint names transformers writes and reads (`module_layout` undone)."""
    moe = getattr(cfg, "moe", None)
    if moe is not None and not moe.fused_on_disk:      # GPT-OSS's checkpoints keep the fused tensors
        state = split_expert_weights(state)
    text = _glm4(cfg)
    if text is not None:
        from lathe.models import glm4
        state = glm4.to_hub(state, text)
    pairs = tuple((new, old) for old, new in HUB_NAMES.get(getattr(cfg, "family", None), ()))
    return {_renamed(k, pairs): v for k, v in state.items()} if pairs else state


def load_into(model: nn.Module, state: dict[str, torch.Tensor], source: str, *,
              optional: tuple[str, ...] = (), hub: bool = True) -> list[str]:
    """Assign `state` (checkpoint names: per-expert MoE weights are fused here; with `hub=False` the tensors of
    another lathe model, in its modules' layout but for per-expert weights, which are fused) to a (meta-device)
    model; names in `optional` may be missing. Returns those missing."""
    state = _drop_unrun_mtp(model, state, source)
    state = module_layout(state, model.config) if hub else fuse_expert_weights(state)
    _drop_absent_mtp(model, state, source)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = set(model.state_dict().keys())
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    required_missing = [k for k in missing if not k.startswith(optional)]
    if required_missing or unexpected:
        raise UnsupportedArchitecture(
            f"{source}: the checkpoint's tensors do not match lathe's {model.config.architecture} decoder: "
            f"missing {required_missing[:8]}, unexpected {unexpected[:8]}. It is a variant lathe does not "
            "implement; the transformers fallback will be used")
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return missing


def _drop_unrun_mtp(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """`state` without the multi-token-prediction layers neither lathe's decoder nor transformers runs (`unrun_mtp`:
    DeepSeek-V3's, GLM-4.5's, HY-V3's `model.layers.<n>`, Qwen3.5's and Qwen3-Next's `mtp.*`), with a log line; saves
    leave them out, as transformers' do, unless `mtp_source` is set (`stacked_mtp_tensors`)."""
    cfg = getattr(model.config, "text", model.config)          # (a VL model's language model)
    kept = {k: v for k, v in state.items() if not unrun_mtp(k, cfg)}
    if len(kept) < len(state):
        what = ("block (mtp.*)" if _keeps_mtp_block(cfg) else
                f"layers of {cfg.architecture} (model.layers.{cfg.num_hidden_layers} and on)")
        log.warning("%s: %d tensors of the multi-token-prediction %s are not loaded: lathe's decoder does not run "
                    "them; checkpoints it saves leave them out unless actor_rollout_ref.model.mtp.enable=true (which "
                    "copies them there unchanged)", source, len(state) - len(kept), what)
    return kept


def _keeps_mtp_block(cfg) -> bool:
    """Whether the family keeps its MTP layers under `mtp.*` (the hybrids, Nemotron-H)."""
    return getattr(cfg, "linear_attention", None) is not None or getattr(cfg, "nemotron", None) is not None


def unrun_mtp(name: str, cfg) -> bool:
    """Whether checkpoint tensor `name` belongs to multi-token-prediction layers lathe's decoder loads but does not
    run: DeepSeek-V3's, GLM-4.5's and HY-V3's `model.layers.<n>` past the decoder's (`stacked_mtp_layers`), the
    hybrids' and Nemotron-H's `mtp.*`."""
    if _keeps_mtp_block(cfg):
        return name.startswith("mtp.")
    if not getattr(cfg, "stacked_mtp_layers", False):
        return False
    for prefix in ("model.layers.", "model.language_model.layers."):      # (GLM-4.5V's: its language model's)
        if name.startswith(prefix):
            index = name[len(prefix):].split(".", 1)[0]
            return index.isdigit() and int(index) >= cfg.num_hidden_layers
    return False


def stacked_mtp_tensors(cfg) -> dict[str, torch.Tensor]:
    """The tensors of the MTP layers lathe does not run (`unrun_mtp`) as `cfg.mtp_source` holds them (their stored
    names and dtype), which saves copy unchanged (`actor_rollout_ref.model.mtp.enable=true`:
    `lathe.train.mtp.keep_checkpoint_mtp`); none when it is unset."""
    source = getattr(cfg, "mtp_source", None)
    return {} if source is None else read_state_dict(source, select=lambda name: unrun_mtp(name, cfg))


def _drop_absent_mtp(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """A config that declares MTP layers (MiMo's `num_nextn_predict_layers`) over a checkpoint holding none of their
    tensors (saved without them): the model loses the empty layers (`config.num_mtp_layers` = 0), with a log line,
    so that the main model still loads; training them (`mtp.enable_train`) then fails, naming the model."""
    from lathe.models.mtp import MTP_PREFIX, has_mtp
    if not has_mtp(model) or any(k.startswith(MTP_PREFIX) for k in state):
        return
    log.warning("%s: config.json declares %d multi-token-prediction layer(s) (num_nextn_predict_layers) but the "
                "checkpoint holds no %s* tensors; the model is loaded without them", source,
                model.config.num_mtp_layers, MTP_PREFIX)
    del model.model.mtp_layers
    model.config.num_mtp_layers = 0


def copy_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], *, who: str) -> None:
    """Copy weights in place by HF name (tied names such as lm_head.weight included); the same storage is skipped."""
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"update_weights: the {who} has no tensor named {name!r}")
            target = params[name]
            if target.data_ptr() != tensor.data_ptr():
                target.copy_(tensor)


def parse_size(size: int | str) -> int:
    """Bytes in "5GB" / "50KB" / "2GiB" / 1000 (decimal units as transformers reads them)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. '5GB', '500MB' or a byte count")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


def export_config(model: nn.Module, dtype: torch.dtype | None = None) -> dict:
    """The config.json to write: the original HF dict with architecture and dtype brought up to date."""
    cfg: LatheConfig = model.config
    d = dict(cfg.hf_config)
    family = cfg.architecture.replace("ForCausalLM", "").replace("ForTokenClassification", "")
    is_value = hasattr(model, "score")
    d["architectures"] = [family + ("ForTokenClassification" if is_value else "ForCausalLM")]
    d.setdefault("model_type", family.lower())
    if is_value:
        d["id2label"], d["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        d["num_labels"] = 1
    d["tie_word_embeddings"] = cfg.tie_word_embeddings
    d.pop("quantization_config", None)     # (a quantised checkpoint's weights were read unquantised: `quantized`)
    dtype = str(dtype or next(model.parameters()).dtype).replace("torch.", "")
    keys = [k for k in ("dtype", "torch_dtype") if k in d] or ["dtype"]
    for k in keys:
        d[k] = dtype
    return d


def save_pretrained(model: nn.Module, path: str | Path, *, max_shard_size: int | str = "5GB",
                    state: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json and the weights (one file, or shards plus an index when over `max_shard_size`);
    `state` (same names as `model.state_dict()`) replaces the module's own tensors."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in (model.state_dict() if state is None else state).items()}
    state = hub_layout(state, model.config)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    config = export_config(model, _weights_dtype(state))
    if getattr(model.config, "vl_checkpoint", None) is not None:     # the whole vision-language model again
        from lathe.models.vl.io import whole_vl_checkpoint
        state, config = whole_vl_checkpoint(model.config, state, _weights_dtype(state), value=hasattr(model, "score"))
    state.update(stacked_mtp_tensors(model.config))
    shards = _shard(state, parse_size(max_shard_size))
    for stale in list(path.glob("model*.safetensors")) + [path / SAFE_INDEX]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SAFE_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(path / SAFE_INDEX, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)


def _weights_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the first floating-point tensor written (what config.json's `dtype` must say)."""
    return next((t.dtype for t in state.values() if t.is_floating_point()), None)


def _shard(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = state[name].to("cpu")
        size += nbytes
    return shards
