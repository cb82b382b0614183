"""Reading a Megatron-Core distributed checkpoint (`torch_dist`) into the Hugging Face names lathe's decoder uses.

verl's Megatron scripts may start from such a checkpoint (`actor_rollout_ref.actor.megatron.use_dist_checkpointing`
with `dist_checkpointing_path`, written by verl's `scripts/converter_hf_to_mcore.py` or a Megatron training run)
instead of the Hugging Face weights; the architecture still comes from `actor_rollout_ref.model.path`'s config.json.

The format (Megatron-LM `megatron/core/dist_checkpointing/`): `metadata.json` names the backend
(`{"sharded_backend": "torch_dist", ...}`, `core.py` `CheckpointingConfig`), the rest is a
`torch.distributed.checkpoint` directory (`.metadata` plus `*.distcp` files) whose entries carry *global* shapes,
whatever tensor/pipeline/expert-parallel layout wrote them (`strategies/torch.py` `mcore_to_pyt_state_dict`). So one
process reads every tensor whole with `FileSystemReader` and `torch.distributed.checkpoint.load(no_dist=True)`;
Megatron itself is not imported. Non-tensor entries (`_extra_state`, `common_state`, a legacy `common.pt`) and
anything outside the model (`optimizer.*`, `rng_state`) are not read; multi-token-prediction layers (`mtp.*`) are
dropped, as lathe drops them from Hugging Face checkpoints.

Names and layouts (the sharded keys of `GPTModel.sharded_state_dict()`, as verl's `load_mcore_dist_weights` and
`converter_hf_to_mcore.py` and mbridge's `models/{qwen2,deepseek_v3}.py` map them):

* a decoder layer's tensors are saved either stacked, `decoder.layers.<name>` with the layer axis prepended (the
  homogeneous layout: `transformer_block.py` `sharded_state_dict` adds `(0, layer, num_layers)` offsets), or numbered,
  `decoder.layers.<i>.<name>` (`non_homogeneous_layers`, which newer Megatron uses for models that mix dense and MoE
  layers, as DeepSeek-V3 does). Both are read; a stacked tensor holds the layers its chunks cover;
* routed experts likewise: `mlp.experts.linear_fc1.weight` with the expert axis prepended (SequentialMLP and
  TEGroupedMLP save the same keys, `moe/experts.py`), or numbered `mlp.experts.<e>.linear_fc1.weight`
  (`singleton_local_shards`); `experts.local_experts.<e>.` and TE's `experts.linear_fc1.weight<e>` spellings too;
* `linear_qkv` is grouped by key/value head: for each of the G groups, its heads/G query heads, then its key head,
  then its value head; `linear_fc1` is [gate; up] (with `singleton_local_shards`, `<key>_w` and `<key>_v`: `mlp.py`
  `apply_swiglu_sharded_factory`);
* the norm before a linear layer is fused into it: `self_attention.linear_qkv.layer_norm_weight` (input norm),
  `mlp.linear_fc1.layer_norm_weight` (a dense layer's post-attention norm; `pre_mlp_layernorm.weight` before MoE),
  MLA's `linear_q_up_proj.layer_norm_weight` / `linear_kv_up_proj.layer_norm_weight` (q_a / kv_a norms);
* `embedding.word_embeddings.weight`, `decoder.final_layernorm.weight`, `output_layer.weight` (absent when tied);
  a vocabulary padded for tensor parallelism is cut back to config.json's `vocab_size`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lathe.models.config import LatheConfig

BACKEND_FILE, DCP_FILE = "metadata.json", ".metadata"
FAMILIES = "Llama, Qwen2, Qwen3, Qwen3-MoE and the DeepSeek-V3 family (Moonlight)"
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
_LAYER = re.compile(r"^decoder\.layers\.(?:(?P<i>\d+)\.)?(?P<rest>.+)$")
# per-expert spellings -> the stacked name
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.)?(?P<e>\d+)\.(?P<rest>.+)$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(?P<proj>linear_fc[12])\.(?P<kind>weight|bias)(?P<e>\d+)$")

# one Megatron name -> one Hugging Face name below model.layers.<i>.
_RENAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.linear_fc1.weight": "mlp.experts.gate_up_proj",      # (E, 2F, H): [gate; up] per expert, as lathe's
    "mlp.experts.linear_fc2.weight": "mlp.experts.down_proj",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_QK_NORM = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}
_MLA = {"self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight"}
# [gate; up] -> two names ({} is gate / up)
_GATE_UP = {"mlp.linear_fc1.weight": "mlp.{}_proj.weight", "mlp.linear_fc1.bias": "mlp.{}_proj.bias",
            "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.{}_proj.weight"}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


class MegatronCheckpointError(ValueError):
    """A Megatron distributed checkpoint lathe cannot read; the message names the path or key and the fix."""


def check_dist_checkpoint(path: str | None, key: str) -> Path:
    """The checkpoint directory `path` (`~` expanded) when it looks like a `torch_dist` checkpoint, else a
    `MegatronCheckpointError` naming `key`. Reads only `metadata.json` (no torch import: start-up checks call it)."""
    fix = ("Fix: set it to the directory Megatron's dist_checkpointing.save wrote (metadata.json, .metadata and "
           "*.distcp files; verl's scripts/converter_hf_to_mcore.py writes one), or use the Hugging Face weights of "
           "actor_rollout_ref.model.path by setting use_dist_checkpointing=false")
    if not path or not str(path).strip():
        raise MegatronCheckpointError(f"{key} is empty, and use_dist_checkpointing=true reads the starting weights "
                                      f"from it. {fix}.")
    local = Path(str(path)).expanduser()
    if not local.is_dir():
        raise MegatronCheckpointError(f"{key}={str(path)!r}: no such directory. {fix}.")
    config = local / BACKEND_FILE
    if not config.is_file():
        raise MegatronCheckpointError(f"{key}={str(path)!r} has no {BACKEND_FILE}, so it is not a Megatron "
                                      f"distributed checkpoint. {fix}.")
    try:
        backend = json.loads(config.read_text()).get("sharded_backend")
    except (ValueError, AttributeError) as e:
        raise MegatronCheckpointError(f"{config} ({key}) is not a Megatron checkpoint config: {e}. {fix}.") from None
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{config} ({key}) says sharded_backend={backend!r}; lathe reads the "
                                      "torch_dist backend only (Megatron's default; the legacy zarr backend is "
                                      "not read). Fix: convert it with Megatron's dist_checkpointing "
                                      "(torch_dist), or use the Hugging Face weights")
    if not (local / DCP_FILE).is_file():
        raise MegatronCheckpointError(f"{key}={str(path)!r} has {BACKEND_FILE} but no {DCP_FILE} (the "
                                      "torch.distributed.checkpoint index): the save did not finish. " + fix + ".")
    return local


def read_megatron_state_dict(path: str | Path, cfg: LatheConfig, *, dtype: torch.dtype | None = None,
                             prefix: str = "", key: str = "dist_checkpointing_path") -> dict[str, torch.Tensor]:
    """The checkpoint's model weights under the Hugging Face names of `cfg`'s architecture (experts stacked as lathe's
    modules hold them), floating tensors cast to `dtype` (DeepSeek-V3's expert-selection bias kept in its own).
    `prefix`: what the saver put before every model key (verl's `dist_checkpointing_prefix`, e.g. NeMo 2's
    'module.')."""
    _check_family(cfg, path)
    local = check_dist_checkpoint(str(path), key)
    raw = _read_tensors(local, prefix)
    layers: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, (t, covered) in raw.items():
        m = _LAYER.match(name)
        if m is None:
            if name not in _TOP:
                raise _unmapped(name, path)
            out[_TOP[name]] = t[:cfg.vocab_size] if name != "decoder.final_layernorm.weight" else t
        elif m["i"] is not None:
            layers.setdefault(int(m["i"]), {})[m["rest"]] = t
        else:
            if t.shape[0] != cfg.num_hidden_layers:
                raise MegatronCheckpointError(
                    f"{path}: {name} stacks {t.shape[0]} layers, and the config.json beside it says "
                    f"num_hidden_layers={cfg.num_hidden_layers}. Fix: point actor_rollout_ref.model.path at the "
                    "model this checkpoint was converted from")
            for i in covered:
                layers.setdefault(i, {})[m["rest"]] = t[i]
    missing = sorted(set(range(cfg.num_hidden_layers)) - layers.keys())
    if missing:
        raise MegatronCheckpointError(f"{path}: no tensors for decoder layers {missing[:8]} of "
                                      f"{cfg.num_hidden_layers}; the checkpoint is incomplete or of another model")
    for i, found in sorted(layers.items()):
        if i >= cfg.num_hidden_layers:
            raise MegatronCheckpointError(f"{path}: decoder.layers.{i}.* is past num_hidden_layers="
                                          f"{cfg.num_hidden_layers}; the checkpoint is of another model")
        out.update(_layer_to_hf(i, _join_experts(_join_swiglu(found)), cfg, path))
    if dtype is not None:
        out = {k: v.to(dtype) if v.is_floating_point() and not k.endswith("e_score_correction_bias") else v
               for k, v in out.items()}
    return out


def _check_family(cfg: LatheConfig, path) -> None:
    other = ("linear attention" if cfg.linear_attention is not None else
             "attention sinks (GPT-OSS)" if cfg.attention_sinks else
             "a vision tower" if "VL" in cfg.architecture else None)
    if other is not None:
        raise MegatronCheckpointError(f"{path}: reading a Megatron checkpoint of {cfg.architecture} ({other}) is not "
                                      f"implemented; lathe maps {FAMILIES}. Fix: convert it to Hugging Face format "
                                      "and set actor_rollout_ref.model.path to it")


def _read_tensors(local: Path, prefix: str = "") -> dict[str, tuple[torch.Tensor, list[int]]]:
    """{key without `prefix`: (whole tensor, indices along its first axis that its chunks cover)} for the model's
    tensor entries."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(str(local))
    entries = reader.read_metadata().state_dict_metadata
    tensors = {k: md for k, md in entries.items() if isinstance(md, TensorStorageMetadata) and k.startswith(prefix)
               and k[len(prefix):].startswith(_MODEL_PREFIXES) and not k[len(prefix):].startswith("mtp.")
               and "_extra_state" not in k}
    if not any(k[len(prefix):].startswith("decoder.") for k in tensors):
        shown = ", ".join(sorted(entries)[:6])
        raise MegatronCheckpointError(f"{local}: no {prefix}decoder.* tensors (its entries start {shown}); lathe "
                                      f"reads a GPTModel's checkpoint of {FAMILIES} (a prefix before every key is "
                                      "megatron.dist_checkpointing_prefix)")
    state = {k: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for k, md in tensors.items()}
    with warnings.catch_warnings():             # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    covered = {k: sorted({i for c in md.chunks for i in range(c.offsets[0], c.offsets[0] + c.sizes[0])})
               if len(md.size) else [] for k, md in tensors.items()}
    return {k[len(prefix):]: (state[k], covered[k]) for k in state}


def _join_swiglu(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`<key>_w` + `<key>_v` (gate and up saved apart) -> `<key>` = [gate; up] along the output axis."""
    import torch
    out = {}
    for name, t in found.items():
        if name.endswith("_v") and name[:-2] + "_w" in found:
            continue
        if name.endswith("_w") and name[:-2] + "_v" in found:
            v = found[name[:-2] + "_v"]
            out[name[:-2]] = torch.cat([t, v], dim=-2 if t.dim() >= 2 and name[:-2].endswith("weight") else -1)
        else:
            out[name] = t
    return out


def _join_experts(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Numbered experts (`mlp.experts.<e>.linear_fc1.weight`, `local_experts.<e>.`, TE's `weight<e>`) -> the stacked
    `mlp.experts.linear_fc1.weight` (E, ...)."""
    import torch
    per: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in found.items():
        m, te = _EXPERT.match(name), _TE_EXPERT.match(name)
        if m is not None:
            per.setdefault(f"mlp.experts.{m['rest']}", {})[int(m["e"])] = t
        elif te is not None:
            per.setdefault(f"mlp.experts.{te['proj']}.{te['kind']}", {})[int(te["e"])] = t
        else:
            out[name] = t
    for name, experts in per.items():
        if sorted(experts) != list(range(len(experts))):
            raise MegatronCheckpointError(f"{name}: experts {sorted(experts)[:8]}... are not numbered 0..E-1; the "
                                          "checkpoint is incomplete")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _layer_to_hf(i: int, found: dict[str, torch.Tensor], cfg: LatheConfig, path) -> dict[str, torch.Tensor]:
    """One decoder layer's Megatron tensors under the names of `model.layers.<i>.`."""
    prefix = f"model.layers.{i}."
    names = {**_RENAME, **(_MLA if cfg.mla is not None else _QK_NORM)}
    out = {}
    for name, t in found.items():
        if name in names:
            out[prefix + names[name]] = t
        elif name in _GATE_UP:
            gate, up = t.chunk(2, dim=0)
            out[prefix + _GATE_UP[name].format("gate")] = gate
            out[prefix + _GATE_UP[name].format("up")] = up
        elif name in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias") and cfg.mla is None:
            kind = name.rpartition(".")[2]
            for proj, part in zip("qkv", _split_qkv(t, cfg)):
                out[f"{prefix}self_attn.{proj}_proj.{kind}"] = part
        else:
            raise _unmapped(f"decoder.layers.{i}.{name}", path)
    return out


def _split_qkv(t: torch.Tensor, cfg: LatheConfig) -> tuple[torch.Tensor, ...]:
    """Megatron's fused q/k/v (per key/value group g: its query heads, k_g, v_g) -> q, k, v in head order."""
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    q_per_group = cfg.num_attention_heads // groups * d
    grouped = t.reshape(groups, q_per_group + 2 * d, *t.shape[1:])
    q, k, v = grouped.split([q_per_group, d, d], dim=1)
    return tuple(p.reshape(-1, *t.shape[1:]).contiguous() for p in (q, k, v))


def _unmapped(name: str, path) -> MegatronCheckpointError:
    return MegatronCheckpointError(
        f"{path}: the Megatron tensor {name} has no Hugging Face counterpart lathe maps; lathe reads the GPTModel "
        f"checkpoints of {FAMILIES} (fused q/k/v or MLA attention, SwiGLU MLPs, routed and shared experts). Fix: "
        "convert the checkpoint to Hugging Face format (e.g. with mbridge) and set actor_rollout_ref.model.path to it")
